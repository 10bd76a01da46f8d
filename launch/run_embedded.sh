#!/usr/bin/env bash
# The embedded default end to end on one machine: SFT warm start of a tiny character model on the
# arithmetic task, then the chosen stage from its HF export, ending with the before/after held-out
# accuracy table.
#   launch/run_embedded.sh [PIPELINE] [RUN_ROOT] [NPROC]   (defaults: grpo, runs, 2 processes; CPU gloo or GPUs NCCL)
# PIPELINE: grpo (SFT -> GRPO), online_dpo (SFT -> online DPO on pairs of its own samples ranked by the
# verifier), dpo (SFT -> DPO on the arithmetic pairs), one of the other pairwise
# losses on the same pairs (ipo, hinge, robust, simpo, cpo, orpo), or rm (SFT -> reward model on the pairs,
# ending with held-out pairwise accuracy), or kto (SFT -> the SFT model's own samples labelled by the verifier
# (launch/sample_pairs.py, KTO rows of the prompts with a passing and a failing sample) -> KTO on them
# (examples/kto_arith.yaml) -> the control: DPO without the NLL term on the pairs of the same samples), or prm (SFT on
# the multi-step chains -> Monte-Carlo step labels of its own samples -> a process RM and an outcome RM on
# them -> held-out best-of-16 reranked by each, ending with the PRM's change over greedy), or ppo (the
# classic three stages: SFT -> RM on pairs of the SFT model's own samples labelled by the verifier
# (launch/sample_pairs.py) -> PPO whose only reward is that RM, the critic started from the RM; ends
# with PPO's before/after held-out accuracy table; iterated as Llama 2 did, PPO_ROUNDS rounds (default 6, ~23 min on 2
# CPU processes): each round samples the current policy, continues the RM on those pairs (RM_PAIRS_FROM=all: on the
# pairs of every round so far, as Llama 2 accumulated its data; default last) and runs PPO (100 steps,
# examples/ppo_arith.yaml) from the last round's policy and critic, in RUN_ROOT/{self_pairs,rm_self,ppo_arith}_rK;
# PPO_ROUNDS=1: one round, without the _r1 suffix), or ppo_verifier (SFT -> PPO whose only reward is the
# verifier, at GRPO's budget: examples/ppo_verifier_arith.yaml, the critic a fresh head on the SFT trunk),
# or judge (issue 27: SFT -> judge rows of (problem, candidate, criterion) -> Y/N with the SFT policy's own samples
# and wrong answers one edit off the right one among the candidates (launch/judge_tools.py data) -> SFT of a judge from
# the SFT export in three stages, the `correct` criterion's rows alone (600 steps at lr 1.5e-3), the same with those
# hard negatives (600 steps at lr 5e-4), then all three criteria (examples/judge_sft_arith.yaml) -> its
# held-out agreement with the labels (`judge agreement  NN.N%`) -> GRPO whose only reward is the judge's rubric
# score (examples/grpo_rubric_arith.yaml) -> GRPO with the verifier, same seed and steps (the control) -> both
# against the SFT policy, ending with the rubric run's `change`; JUDGE_STEPS sets both GRPO runs' steps, default
# 200: every step asks the judge three criteria per sample),
# or rlaif (issue 27: judge's stages up to the agreement -> RL-CAI labels of 8 pairs of SFT samples per training prompt from
# that judge (accept_at 0.9), pointwise on the `correct` criterion as a one-principle constitution (launch/cai_tools.py label, the
# config judge_tools.py data writes, overrides in LABEL_OVERRIDES) -> DPO (examples/dpo_arith.yaml) on the AI labels,
# and as the control on the verifier's labels of the same samples -> both against the SFT policy, with the labels'
# agreement with the verifier (`label agreement  NN.N%`), ending with `change` of the AI-label run),
# or critique_revise (issue 27: judge's rows -> a reviser SFT from the SFT export on their critique / revision rows
# (1500 steps: at 600 its revisions were 30% right, at 1500 55%; REVISER_OVERRIDES) -> SL-CAI critique-revise of the SFT policy's samples by that reviser (launch/cai_tools.py
# critique-revise with the config judge_tools.py data writes, CAI_OVERRIDES) -> SFT from the SFT export on the
# revisions and, as the control, on the initial samples (examples/sft_arith.yaml) -> both against the SFT policy, with
# the verifier accuracy of the initial samples and of the revisions, ending with `change` of the revisions' SFT).
# or tools (issue 28: SFT from scratch on tool-using traces driven through ToolEnv (launch/tool_traces.py data,
# examples/sft_tools_arith.yaml) -> GRPO with the calculator (examples/grpo_tools_arith.yaml, turns ending at eos
# as the traces do: no '</tool_call>' stop string, 96 tokens a turn for a 86-token call) -> the control: a plain SFT
# with direct answers on the same training problems and steps, then GRPO without tools on the same prompts with the
# same steps -> held-out table of all four, with the share of episodes that called the tool correctly, ending with
# `change` = GRPO with tools minus GRPO without (launch/tool_traces.py compare, overrides in COMPARE_OVERRIDES);
# TOOLS_STEPS sets both GRPO runs' steps, default 200).
# or user_sim (issue 28: SFT from scratch on dialogues of an impatient scripted assistant with the simulated user
# ArithmeticUser (launch/user_sim.py data, examples/sft_user_sim.yaml) -> GRPO whose only reward is the user's final
# score e_T / 100 (examples/grpo_user_sim.yaml) -> held-out table of both (launch/user_sim.py compare: sampled and
# greedy dialogues, well-formed replies), ending with `change` (points of mean score) and `ratio` (after / before);
# USER_SIM_STEPS sets the GRPO steps, default that of the example).
# or moe (issue 30: a tiny Qwen3-MoE from scratch (launch/moe_run.py init: 8 experts of width 192, top-2) -> SFT at
# ep = 2 (examples/sft_moe_arith.yaml) -> GRPO at ep = 2 with routing replay and again without (examples/
# grpo_moe_arith.yaml) -> the control: the dense from-scratch Qwen3 of the same active size (sft_arith.yaml's 384-wide
# SwiGLU = 2 x 192) through SFT and the same GRPO at ep = 1 -> a table of held-out accuracy before / after each
# GRPO run and its rollout / trainer log-prob mismatch (launch/moe_run.py summary, $ROOT/moe_summary.json); needs
# NPROC even (ep = 2 divides dp); MOE_STEPS sets the three GRPO runs' steps, default that of the example).
# Extra `key=value` overrides for the last stage go in STAGE_OVERRIDES (GRPO_OVERRIDES is kept as its
# name for grpo), for SFT in SFT_OVERRIDES, for ppo's and kto's sampling in PAIRS_OVERRIDES, for kto's DPO
# control in CONTROL_OVERRIDES, for ppo's RM stage
# in RM_OVERRIDES, for judge's, rlaif's and critique_revise's rows in DATA_OVERRIDES and their judge SFT (both
# stages) in JUDGE_OVERRIDES (STAGE_OVERRIDES go to both GRPO runs of judge, both DPO runs of rlaif and both SFT runs
# of critique_revise), for the tools and user_sim tables in COMPARE_OVERRIDES.
set -euo pipefail
cd "$(dirname "$0")/.."
PIPELINE=grpo
case "${1:-}" in
  grpo|online_dpo|dpo|ipo|hinge|robust|simpo|cpo|orpo|rm|kto|prm|ppo|ppo_verifier|judge|rlaif|critique_revise|tools|user_sim|moe) PIPELINE=$1; shift ;;
esac
ROOT=${1:-runs}
NPROC=${2:-2}
PYTHON=${PYTHON:-python}
case "${RM_PAIRS_FROM:-last}" in
  all|last) ;;
  *) echo "error: RM_PAIRS_FROM=$RM_PAIRS_FROM: expected 'all' (every round's pairs) or 'last' (the round's own)" >&2; exit 2 ;;
esac
# a rank killed by a fatal signal prints every thread's Python stack (a rank 1 SIGABRT at process exit after a finished
# stage was seen three times and not reproduced since: BENCHMARKS.md, "A rank aborting at exit")
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
run() { "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$@"; }
if [ "$PIPELINE" = prm ]; then
  DATA="$ROOT/prm_data"
  # SFT on the first 800 training chains; the PRM's data are the policy's samples of the other 800
  run launch/prm_tools.py data out_dir="$DATA" sft_prompts=800
  run launch/train_sft.py --config examples/sft_chain.yaml run_dir="$ROOT/sft_chain" \
      data.path="$DATA/chain_train.jsonl" data.eval_path="$DATA/chain_held_out.jsonl" ${SFT_OVERRIDES:-}
  run launch/prm_tools.py label policy="$ROOT/sft_chain/hf" out="$DATA/mc_steps.jsonl" first_prompt=800
  for SUPERVISE in steps outcome; do
    NAME=$([ "$SUPERVISE" = steps ] && echo prm || echo orm)
    run launch/train_prm.py --config examples/prm_chain.yaml run_dir="$ROOT/${NAME}_chain" \
        model.path="$ROOT/sft_chain/hf" data.path="$DATA/mc_steps.jsonl" algo.supervise="$SUPERVISE" ${STAGE_OVERRIDES:-}
  done
  run launch/prm_tools.py best_of_n policy="$ROOT/sft_chain/hf" \
      prm="$ROOT/prm_chain/hf" orm="$ROOT/orm_chain/hf" out="$ROOT/best_of_n.json"
  exit 0
fi
if [ "$PIPELINE" = tools ]; then
  DATA="$ROOT/tool_traces" STEPS=${TOOLS_STEPS:-200} SFT_STEPS=$(sed -n 's/^steps: //p' examples/sft_tools_arith.yaml)
  run launch/tool_traces.py data out_dir="$DATA"
  run launch/train_sft.py --config examples/sft_tools_arith.yaml run_dir="$ROOT/sft_tools_arith" \
      data.path="$DATA/tool_traces_train.jsonl" ${SFT_OVERRIDES:-}
  run launch/train_sft.py --config examples/sft_arith.yaml run_dir="$ROOT/sft_plain_arith" steps="$SFT_STEPS" \
      data.arith.max_operand=999 "data.arith.ops=['*']" data.arith.num_problems=5000 ${SFT_OVERRIDES:-}
  run launch/train_grpo.py --config examples/grpo_tools_arith.yaml run_dir="$ROOT/grpo_tools_arith" \
      actor.path="$ROOT/sft_tools_arith/hf" steps="$STEPS" ${STAGE_OVERRIDES:-}
  run launch/train_grpo.py --config examples/grpo_tools_arith.yaml run_dir="$ROOT/grpo_no_tools_arith" \
      actor.path="$ROOT/sft_plain_arith/hf" rollout.env=null rollout.max_response_length=16 \
      steps="$STEPS" ${STAGE_OVERRIDES:-}
  run launch/tool_traces.py compare tools_before="$ROOT/sft_tools_arith/hf" tools_after="$ROOT/grpo_tools_arith/hf" \
      plain_before="$ROOT/sft_plain_arith/hf" plain_after="$ROOT/grpo_no_tools_arith/hf" \
      prompts="$DATA/arith_held_out.jsonl" summary_path="$ROOT/tools_compare.json" ${COMPARE_OVERRIDES:-}
  exit 0
fi
if [ "$PIPELINE" = user_sim ]; then
  DATA="$ROOT/user_sim_data" STEPS=${USER_SIM_STEPS:-$(sed -n 's/^steps: //p' examples/grpo_user_sim.yaml)}
  run launch/user_sim.py data out_dir="$DATA"
  run launch/train_sft.py --config examples/sft_user_sim.yaml run_dir="$ROOT/sft_user_sim" \
      data.path="$DATA/user_sim_traces_train.jsonl" ${SFT_OVERRIDES:-}
  run launch/train_grpo.py --config examples/grpo_user_sim.yaml run_dir="$ROOT/grpo_user_sim" \
      actor.path="$ROOT/sft_user_sim/hf" data.path="$DATA/user_sim_train.jsonl" \
      data.eval_path="$DATA/user_sim_held_out.jsonl" steps="$STEPS" ${STAGE_OVERRIDES:-}
  run launch/user_sim.py compare before="$ROOT/sft_user_sim/hf" after="$ROOT/grpo_user_sim/hf" \
      prompts="$DATA/user_sim_held_out.jsonl" summary_path="$ROOT/user_sim_compare.json" ${COMPARE_OVERRIDES:-}
  exit 0
fi
if [ "$PIPELINE" = moe ]; then
  STEPS=${MOE_STEPS:-$(sed -n 's/^steps: //p' examples/grpo_moe_arith.yaml)}
  run launch/moe_run.py init out="$ROOT/moe_init"
  run launch/train_sft.py --config examples/sft_moe_arith.yaml run_dir="$ROOT/sft_moe_arith" \
      model.path="$ROOT/moe_init" ${SFT_OVERRIDES:-}
  run launch/train_sft.py --config examples/sft_arith.yaml run_dir="$ROOT/sft_dense_arith" model.model_type=qwen3 \
      ${SFT_OVERRIDES:-}
  for REPLAY in true false; do
    run launch/train_grpo.py --config examples/grpo_moe_arith.yaml run_dir="$ROOT/grpo_moe_replay_$REPLAY" \
        actor.path="$ROOT/sft_moe_arith/hf" actor.routing_replay="$REPLAY" steps="$STEPS" ${STAGE_OVERRIDES:-}
  done
  run launch/train_grpo.py --config examples/grpo_moe_arith.yaml run_dir="$ROOT/grpo_dense_arith" \
      actor.path="$ROOT/sft_dense_arith/hf" actor.ep=1 actor.routing_replay=false steps="$STEPS" ${STAGE_OVERRIDES:-}
  run launch/moe_run.py summary "sft={moe: $ROOT/sft_moe_arith, dense: $ROOT/sft_dense_arith}" \
      "grpo={moe_replay: $ROOT/grpo_moe_replay_true, moe_no_replay: $ROOT/grpo_moe_replay_false, dense: $ROOT/grpo_dense_arith}" \
      "start={moe_replay: moe, moe_no_replay: moe, dense: dense}" summary_path="$ROOT/moe_summary.json"
  exit 0
fi
run launch/train_sft.py --config examples/sft_arith.yaml run_dir="$ROOT/sft_arith" ${SFT_OVERRIDES:-}
case "$PIPELINE" in
  grpo)
    run launch/train_grpo.py --config examples/grpo_arith.yaml run_dir="$ROOT/grpo_arith" \
        actor.path="$ROOT/sft_arith/hf" ${GRPO_OVERRIDES:-} ${STAGE_OVERRIDES:-} ;;
  online_dpo)
    run launch/train_online_dpo.py --config examples/online_dpo_arith.yaml run_dir="$ROOT/online_dpo_arith" \
        actor.path="$ROOT/sft_arith/hf" ${STAGE_OVERRIDES:-} ;;
  kto)
    run launch/sample_pairs.py model_path="$ROOT/sft_arith/hf" out_dir="$ROOT/kto_samples" \
        samples_per_prompt=8 pairs_per_prompt=4 unpaired_prompts=paired ${PAIRS_OVERRIDES:-}
    run launch/train_kto.py --config examples/kto_arith.yaml run_dir="$ROOT/kto_arith" \
        model.path="$ROOT/sft_arith/hf" data.path="$ROOT/kto_samples/unpaired.jsonl" \
        data.eval_path="$ROOT/kto_samples/data/arith_held_out.jsonl" ${STAGE_OVERRIDES:-}
    run launch/train_dpo.py --config examples/dpo_arith.yaml run_dir="$ROOT/kto_control_dpo" \
        model.path="$ROOT/sft_arith/hf" data.path="$ROOT/kto_samples/pairs.jsonl" \
        data.eval_path="$ROOT/kto_samples/data/arith_held_out.jsonl" algo.nll_coef=0 ${CONTROL_OVERRIDES:-} ;;
  rm)
    run launch/train_rm.py --config examples/rm_arith.yaml run_dir="$ROOT/rm_arith" \
        model.path="$ROOT/sft_arith/hf" ${STAGE_OVERRIDES:-} ;;
  ppo)
    # iterated RLHF (Llama 2, section 3.2.3): PPO_ROUNDS rounds; before each, pairs of the current policy's own samples
    # labelled by the verifier (the human labellers' stand-in) and the RM continued on them from the last round's RM
    # (RM_PAIRS_FROM=all: on the pairs of every round so far)
    POLICY="$ROOT/sft_arith/hf" RM_INIT="$ROOT/sft_arith/hf" CRITIC=""
    ROUNDS=${PPO_ROUNDS:-6} PAIRS_SEEN=()
    for ROUND in $(seq 1 "$ROUNDS"); do
      SUFFIX=$([ "$ROUNDS" = 1 ] && echo "" || echo "_r$ROUND")
      run launch/sample_pairs.py model_path="$POLICY" out_dir="$ROOT/self_pairs$SUFFIX" seed=$((ROUND - 1)) \
          samples_per_prompt=16 pairs_per_prompt=16 ${PAIRS_OVERRIDES:-}
      PAIRS_SEEN+=("$ROOT/self_pairs$SUFFIX/pairs.jsonl") RM_PAIRS="$ROOT/self_pairs$SUFFIX/pairs.jsonl"
      if [ "${RM_PAIRS_FROM:-last}" = all ] && [ "$ROUND" -gt 1 ]; then
        RM_PAIRS="$ROOT/self_pairs$SUFFIX/pairs_all_rounds.jsonl"
        cat "${PAIRS_SEEN[@]}" > "$RM_PAIRS"
      fi
      run launch/train_rm.py --config examples/rm_arith.yaml run_dir="$ROOT/rm_self$SUFFIX" \
          model.path="$RM_INIT" data.path="$RM_PAIRS" \
          data.eval_path="$ROOT/self_pairs$SUFFIX/pairs_held_out.jsonl" algo.margin=false steps=400 ${RM_OVERRIDES:-}
      run launch/train_ppo.py --config examples/ppo_arith.yaml run_dir="$ROOT/ppo_arith$SUFFIX" \
          actor.path="$POLICY" reference.path="$ROOT/sft_arith/hf" critic.path="${CRITIC:-$ROOT/rm_self$SUFFIX/hf}" \
          reward.model.path="$ROOT/rm_self$SUFFIX/hf" ${STAGE_OVERRIDES:-}
      POLICY="$ROOT/ppo_arith$SUFFIX/hf" RM_INIT="$ROOT/rm_self$SUFFIX/hf" CRITIC="$ROOT/ppo_arith$SUFFIX/critic_hf"
    done ;;
  ppo_verifier)
    run launch/train_ppo.py --config examples/ppo_verifier_arith.yaml run_dir="$ROOT/ppo_verifier_arith" \
        actor.path="$ROOT/sft_arith/hf" ${STAGE_OVERRIDES:-} ;;
  judge|rlaif|critique_revise)
    DATA="$ROOT/judge_data" STEPS=${JUDGE_STEPS:-200}
    run launch/judge_tools.py data out_dir="$DATA" policy="$ROOT/sft_arith/hf" ${DATA_OVERRIDES:-}
    if [ "$PIPELINE" = critique_revise ]; then
      # a reviser fine-tuned from the SFT policy on critique and revision rows, then SL-CAI from the SFT policy's
      # samples, then SFT of the SFT policy on the revisions and, as the control, on the initial samples
      run launch/train_sft.py --config examples/sft_arith.yaml run_dir="$ROOT/reviser_arith" \
          model.path="$ROOT/sft_arith/hf" data.path="$DATA/reviser_train.jsonl" data.max_length=128 steps=1500 \
          ${REVISER_OVERRIDES:-}
      run launch/cai_tools.py critique-revise --config "$DATA/revise.yaml" policy="$ROOT/sft_arith/hf" \
          reviser="$ROOT/reviser_arith/hf" out_dir="$ROOT/cai_sft" ${CAI_OVERRIDES:-}
      for ROWS in sft sft_initial; do
        run launch/train_sft.py --config examples/sft_arith.yaml run_dir="$ROOT/${ROWS}_cai" \
            model.path="$ROOT/sft_arith/hf" data.path="$ROOT/cai_sft/$ROWS.jsonl" ${STAGE_OVERRIDES:-}
      done
      REPORT="$ROOT/cai_sft/critique-revise_report.json"
      run launch/judge_tools.py compare before="$ROOT/sft_arith/hf" prompts="$DATA/prompts_held_out.jsonl" \
          "after=[$ROOT/sft_cai/hf, $ROOT/sft_initial_cai/hf]" \
          "names=[SFT on the revisions, SFT on the initial samples (control)]" \
          "quotes={initial samples' accuracy: $REPORT:train.initial_accuracy, revisions' accuracy: $REPORT:train.final_accuracy}"
      exit 0
    fi
    # the judge's curriculum: the comparison (`correct` rows) alone, then with the hard negatives, then all three
    # criteria from that judge
    run launch/train_sft.py --config examples/judge_sft_arith.yaml run_dir="$ROOT/judge_correct" \
        model.path="$ROOT/sft_arith/hf" data.path="$DATA/judge_train_correct.jsonl" steps=600 optim.lr=1.5e-3 \
        ${JUDGE_OVERRIDES:-}
    run launch/train_sft.py --config examples/judge_sft_arith.yaml run_dir="$ROOT/judge_hard" \
        model.path="$ROOT/judge_correct/hf" data.path="$DATA/judge_train_hard.jsonl" steps=600 optim.lr=5e-4 \
        ${JUDGE_OVERRIDES:-}
    run launch/train_sft.py --config examples/judge_sft_arith.yaml run_dir="$ROOT/judge_arith" \
        model.path="$ROOT/judge_hard/hf" data.path="$DATA/judge_train.jsonl" ${JUDGE_OVERRIDES:-}
    run launch/judge_tools.py agreement judge="$ROOT/judge_arith/hf" items="$DATA/judge_held_out.jsonl" \
        summary_path="$ROOT/judge_agreement.json"
    if [ "$PIPELINE" = rlaif ]; then
      # AI labels of 8 pairs of SFT samples per training prompt from the judge (pointwise, the `correct` criterion as the
      # constitution), and the verifier's labels of the same samples as the control
      run launch/cai_tools.py label --config "$DATA/label.yaml" policy="$ROOT/sft_arith/hf" \
          judge.path="$ROOT/judge_arith/hf" out_dir="$ROOT/rlaif" ${LABEL_OVERRIDES:-}
      for LABELS in ai verifier; do
        PAIRS=$([ "$LABELS" = ai ] && echo pairs || echo pairs_verifier)
        run launch/train_dpo.py --config examples/dpo_arith.yaml run_dir="$ROOT/dpo_${LABELS}_labels" \
            model.path="$ROOT/sft_arith/hf" data.path="$ROOT/rlaif/$PAIRS.jsonl" ${STAGE_OVERRIDES:-}
      done
      run launch/judge_tools.py compare before="$ROOT/sft_arith/hf" prompts="$DATA/prompts_held_out.jsonl" \
          "after=[$ROOT/dpo_ai_labels/hf, $ROOT/dpo_verifier_labels/hf]" \
          "names=[DPO on the judge's labels, DPO on the verifier's labels (control)]" \
          "quotes={label agreement: $ROOT/rlaif/label_report.json:train.verifier_agreement}"
      exit 0
    fi
    # the rubric config's runs/ paths (the judge's among them, inside a list) under ROOT
    sed "s#\([ :]\)runs/#\1$ROOT/#" examples/grpo_rubric_arith.yaml > "$ROOT/grpo_rubric_arith.yaml"
    run launch/train_grpo.py --config "$ROOT/grpo_rubric_arith.yaml" steps="$STEPS" ${STAGE_OVERRIDES:-}
    run launch/train_grpo.py --config examples/grpo_arith.yaml run_dir="$ROOT/grpo_verifier_arith" \
        actor.path="$ROOT/sft_arith/hf" data.path="$DATA/prompts_train.jsonl" data.eval_path="$DATA/prompts_held_out.jsonl" \
        steps="$STEPS" ${STAGE_OVERRIDES:-}
    run launch/judge_tools.py compare before="$ROOT/sft_arith/hf" prompts="$DATA/prompts_held_out.jsonl" \
        "after=[$ROOT/grpo_rubric_arith/hf, $ROOT/grpo_verifier_arith/hf]" agreement="$ROOT/judge_agreement.json" ;;
  dpo)
    run launch/train_dpo.py --config examples/dpo_arith.yaml run_dir="$ROOT/dpo_arith" \
        model.path="$ROOT/sft_arith/hf" ${STAGE_OVERRIDES:-} ;;
  *)
    run launch/train_dpo.py --config examples/dpo_arith.yaml run_dir="$ROOT/${PIPELINE}_arith" \
        model.path="$ROOT/sft_arith/hf" algo.loss="$PIPELINE" ${STAGE_OVERRIDES:-} ;;
esac
