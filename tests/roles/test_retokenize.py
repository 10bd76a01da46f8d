"""Tokenizer identity between the actor and the roles that read its ids, and the re-tokenising path of an outcome
reward model with its own tokenizer (`reward.models[].tokenizer: own`).

The actor is the tiny character-vocabulary policy (no tokenizer files: the character tokenizer). The "other" RM has
the same 99 ids over the same characters in reverse order, so the vocabulary sizes agree and only the identity check
can tell them apart; its scores are compared with transformers' sequence classifier on transformers' own rendering of
the RM's chat template."""
import functools
import logging

import pytest
import torch
import transformers
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy, tiny_config
from trainers.test_ppo_trainer import tiny_ppo_config

from megalign.config import ConfigError, load_config
from megalign.data import CharTokenizer
from megalign.models import RewardModel
from megalign.roles.reward import RewardConfig
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.model_checks import ModelError
from megalign.trainers.ppo import PPOTrainer

RM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant] {% endif %}")


def save_reversed_tokenizer(path, template=RM_TEMPLATE):
    """An HF fast tokenizer with CharTokenizer's specials and characters, the characters in reverse id order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = CharTokenizer.SPECIALS
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + tuple(CharTokenizer.CHARS[::-1]))}))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    fast.save_pretrained(str(path))


def _call(test, args, kwargs):
    test(*args, **kwargs)


def on_one_rank(test):
    """Run the test's body as the one rank of a gloo group in a forked process (the trainers need a process group)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        run_distributed(_call, test, args, kwargs, world_size=1)
    return wrapper


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("retokenize")
    out = {"policy": tiny_policy(root / "policy"), "other": tiny_policy(root / "other", 5, model_cls=RewardModel, std=0.3),
           "plain": tiny_policy(root / "plain", 6, model_cls=RewardModel, std=0.3),
           "same": tiny_policy(root / "same", 7, model_cls=RewardModel, std=0.3),
           "bare": tiny_policy(root / "bare", 8, model_cls=RewardModel, std=0.3)}
    save_reversed_tokenizer(out["other"])
    save_reversed_tokenizer(out["plain"], template=None)
    CharTokenizer().save(out["same"])  # the actor's tokenizer, exported
    return out


def rm_overrides(path, *extra):
    return [f"reward.models=[{{name: rm, path: {path}{''.join(', ' + e for e in extra)}}}]"]


@on_one_rank
def test_rm_with_another_tokenizer_of_the_same_size_is_refused(models, tmp_path):
    with pytest.raises(ModelError, match=r"reward.models\[0\].path=.*another tokenizer .*\(char: .*differ in vocabulary"
                                         r".*tokenizer=own"):
        GRPOTrainer(tiny_config(models["policy"], tmp_path / "run", *rm_overrides(models["other"])))


@on_one_rank
def test_identity_check_passes_for_the_actors_tokenizer_and_folders_without_one(models, tmp_path):
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megalign.trainers.model_checks")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    trainer = GRPOTrainer(tiny_config(models["policy"], tmp_path / "run",
                          f"reward.models=[{{name: a, path: {models['same']}}}, {{name: b, path: {models['bare']}}}]"))
    assert [m.tokenizer for m in trainer.reward.outcome] == [None, None]
    assert [m for m in records if "has no tokenizer files: only its vocabulary size is checked" in m] == [
        f"reward.models[1].path={models['bare']!r} has no tokenizer files: only its vocabulary size is checked against "
        f"the run's tokenizer (char)"]


def hand_scores(path, prompts, responses, template):
    """transformers' classifier at the last token of transformers' own tokenisation of each (prompt, response)."""
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    for prompt, response in zip(prompts, responses):
        if template:
            text = tok.apply_chat_template([{"role": "user", "content": prompt},
                                            {"role": "assistant", "content": response}], tokenize=False)
        else:  # plain concatenation: BOS, prompt, response, EOS
            text = tok.bos_token + prompt + response + tok.eos_token
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            scores.append(hf(input_ids=ids).logits[0, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("which,template", [("other", True), ("plain", False)])
@on_one_rank
def test_own_tokenizer_scores_the_retokenised_text(models, tmp_path, which, template):
    trainer = GRPOTrainer(tiny_config(models["policy"], tmp_path / "run", *rm_overrides(models[which], "tokenizer: own")))
    rm = trainer.reward.outcome[0]
    assert rm.tokenizer is not None and rm.tokenizer.path == models[which]
    prompts, responses = ["user: 1+2=\nassistant: ", "3+4="], ["3", "a longer answer: 7"]
    actor = CharTokenizer()
    rows = [actor.encode(p + r, add_bos=True) for p, r in zip(prompts, responses)]
    width = max(map(len, rows))  # actor ids, which the RM must not read
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    total, terms = trainer.reward.score(prompts, responses, [None, None], [{}, {}], ids, mask)
    expected = hand_scores(models[which], prompts, responses, template)
    torch.testing.assert_close(terms["rm"], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rm.score(ids, mask), expected, atol=1e-3)  # the actor's ids mean other text to it
    with pytest.raises(ValueError, match="response 0 is .* tokens in its own tokenizer .*max_position_embeddings=64"):
        rm.encode_texts(["x" * 70], ["y"])


@on_one_rank
def test_own_tokenizer_needs_tokenizer_files(models, tmp_path):
    with pytest.raises(ModelError, match=r"tokenizer=own but .* holds no tokenizer files"):
        GRPOTrainer(tiny_config(models["policy"], tmp_path / "run",
                                *rm_overrides(models["policy"], "tokenizer: own")))


def test_process_rm_refuses_own_tokenizer():
    with pytest.raises(ConfigError, match="a process reward model scores each actor token"):
        load_config(RewardConfig, None, ["models=[{name: p, path: x, kind: process, tokenizer: own}]"])


@on_one_rank
def test_critic_keeps_the_identity_requirement(models, tmp_path):
    with pytest.raises(ModelError, match=r"critic.path=.*another tokenizer.*critic.path unset.*set critic.path"):
        PPOTrainer(tiny_ppo_config(models["policy"], tmp_path / "run", *rm_overrides(models["other"], "tokenizer: own")))
    with pytest.raises(ModelError, match=r"critic.path=.*another tokenizer"):
        PPOTrainer(tiny_ppo_config(models["policy"], tmp_path / "run2", f"critic.path={models['other']}"))


@on_one_rank
def test_reference_keeps_the_identity_requirement(models, tmp_path):
    with pytest.raises(ModelError, match=r"reference.path=.*another tokenizer.*differ in vocabulary"):
        PPOTrainer(tiny_ppo_config(models["policy"], tmp_path / "run", "algo.kl_coef=0.01",
                                   f"reference.path={models['other']}"))


@on_one_rank
def test_supervised_reference_keeps_the_identity_requirement(models, tmp_path):
    from megalign.trainers.preference import DPOConfig, PairwiseObjective
    from megalign.trainers.supervised import SupervisedTrainer
    cfg = load_config(DPOConfig, None, [f"run_dir={tmp_path / 'run'}", f"model.path={models['policy']}",
                                        f"reference.path={models['other']}", "steps=1", "batch_size=8",
                                        "data.arith.max_operand=4", "data.max_length=40", "tensorboard=false"])
    with pytest.raises(ModelError, match=r"reference.path=.*another tokenizer.*differ in vocabulary"):
        SupervisedTrainer(cfg, PairwiseObjective, "DPO")
