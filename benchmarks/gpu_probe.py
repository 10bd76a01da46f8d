"""Step 3 of benchmarks/gpu_check.sh: the kernels at the sizes the trainers run, checked against fp32
torch on the same device and timed beside the device's own read and copy rates.

    python3 benchmarks/gpu_probe.py --out DIR            (CUDA: the sizes below)
    python benchmarks/gpu_probe.py --device cpu          (the same checks at small sizes, so a short
                                                          GPU slot is not spent on a typo)

Each check runs on its own, prints one JSON line {"check", "ok", "seconds", ...figures} and appends
it to DIR/probe.jsonl; a check that raises or misses its tolerance is reported and the next one
runs. The exit status is the number of failed checks.

Checks:
- token_logprob: bf16 logits [N, V] (CUDA: N = 16384, V = 151936, so N*V > 2^31 and the last rows
  need 64-bit offsets), with ignored rows: log-probs, entropy and the logits' gradient against
  log_softmax in fp32 on the same device (row chunks). Bounds: log-prob and entropy within 1e-3 of
  fp32 torch (both read the same bf16 values and accumulate in fp32); each gradient element within
  one bf16 rounding (2^-8 relative) of the fp32 gradient plus 1e-6 of the row's largest.
- fused_linear: `fused_linear_token_logprob` on a padded head (weight [Vs, H] with valid < Vs rows,
  as a tp-padded vocabulary), bf16, against eager `log_softmax(h @ w[:valid].T)`: log-probs,
  entropy, d hidden, d weight (zero in the padding rows); time and peak memory of both. Also the
  two ways of accumulating the bf16 weight gradient into its fp32 buffer, timed at the head's
  shape: a bf16 product added into the buffer (today) and an fp32-output addmm into it.
- nan_row / gae_lambda0: a row [NaN, 1.0] gives NaN log-prob and entropy; GAE with lam = 0 and a
  NaN value at k leaves every position but k and k - 1 finite (the CUDA scan's composed maps).
- roofline: CUDA-event timings (median of repeated calls) of the token_logprob forward (with and
  without entropy) and backward, beside logits.amax(-1) (one read of the logits: the measured read
  roofline) and logits.clone() (a read and a write: the copy roofline); GB/s, the fractions of
  those, and of the spec bandwidth MEGALIGN_HBM_GBPS (default 4800, an H200's 4.8 TB/s).
- small_ops: kl_penalty_masked_mean, policy_loss, gae and group_advantages at a GRPO batch's size
  against their pure-torch references (values) and timed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from megalign import ops
from megalign.ops.gae import gae
from megalign.ops.group_advantages import group_advantages
from megalign.ops.kl_penalty import kl_penalty_masked_mean
from megalign.ops.policy_loss import policy_loss
from megalign.ops.reference.gae import gae as reference_gae
from megalign.ops.reference.group_advantages import group_advantages as reference_group_advantages
from megalign.ops.reference.kl_penalty import kl_penalty_masked_mean as reference_kl_masked_mean
from megalign.ops.reference.policy_loss import policy_loss as reference_policy_loss
from megalign.ops.token_logprob import token_logprob, token_logprob_shard_backward
from megalign.parallel.logprob import fused_linear_token_logprob

SIZES = {
    "cuda": dict(n=16384, v=151936, fused_n=4096, fused_h=4096, fused_vs=151936, fused_valid=151655,
                 acc_rows=1024, ops_rows=512, ops_cols=4096, group=16, repeats=20),
    "cpu": dict(n=16, v=151936, fused_n=64, fused_h=64, fused_vs=1024, fused_valid=1001,
                acc_rows=64, ops_rows=16, ops_cols=512, group=8, repeats=3),
}
IGNORE = -100


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() over `repeats` calls: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def fp32_token_logprob(x: torch.Tensor, targets: torch.Tensor, w_logp: torch.Tensor, w_ent: torch.Tensor,
                       rows: int = 2048):
    """log p, entropy and d(sum(w_logp * logp + w_ent * entropy))/dx in fp32 torch, by row chunks."""
    logp, ent, grad = [], [], torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], rows):
        e = min(s + rows, x.shape[0])
        xs = x[s:e].float().requires_grad_(True)
        t = targets[s:e]
        keep = t != IGNORE
        lsm = torch.log_softmax(xs, dim=-1)
        lp = torch.where(keep, lsm.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
        h = torch.where(keep, -(lsm.exp() * lsm).sum(-1), 0.0)
        (g,) = torch.autograd.grad((lp * w_logp[s:e]).sum() + (h * w_ent[s:e]).sum(), xs)
        logp.append(lp.detach())
        ent.append(h.detach())
        grad[s:e] = g
        del xs, lsm, g
    return torch.cat(logp), torch.cat(ent), grad


def check_token_logprob(device: str, sz: dict) -> dict:
    n, v = sz["n"], sz["v"]
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(n, v, device=device, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    targets[::97] = IGNORE
    w_logp = torch.randn(n, device=device, generator=g)
    w_ent = torch.randn(n, device=device, generator=g)
    ref_logp, ref_ent, ref_grad = fp32_token_logprob(x, targets, w_logp, w_ent)
    logp_only = token_logprob(x, targets)
    xg = x.clone().requires_grad_(True)
    logp, ent = token_logprob(xg, targets, return_entropy=True)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    grad = xg.grad.float()
    # one bf16 rounding of the fp32 gradient, plus 1e-6 of its row's largest magnitude
    bound = ref_grad.abs() * 2.0 ** -8 + 1e-6 * ref_grad.abs().amax(-1, keepdim=True)
    grad_excess = ((grad - ref_grad).abs() - bound).max().item()
    out = dict(n=n, v=v, n_times_v_over_2_31=n * v / 2 ** 31,
               logp_err=max_abs(logp, ref_logp), logp_no_entropy_err=max_abs(logp_only, ref_logp),
               entropy_err=max_abs(ent, ref_ent), grad_max_err=max_abs(grad, ref_grad),
               grad_excess_over_bound=grad_excess,
               last_row_logp_err=max_abs(logp[-1:], ref_logp[-1:]),
               ignored_rows_zero=bool((logp[targets == IGNORE] == 0).all() and (grad[targets == IGNORE] == 0).all()))
    out["ok"] = (out["logp_err"] <= 1e-3 and out["logp_no_entropy_err"] <= 1e-3 and out["entropy_err"] <= 1e-3
                 and grad_excess <= 0 and out["ignored_rows_zero"])
    return out


def check_fused_linear(device: str, sz: dict) -> dict:
    n, h, vs, valid = sz["fused_n"], sz["fused_h"], sz["fused_vs"], sz["fused_valid"]
    g = torch.Generator(device=device).manual_seed(1)
    hidden = (torch.randn(n, h, device=device, generator=g)).to(torch.bfloat16)
    weight = (torch.randn(vs, h, device=device, generator=g) / math.sqrt(h)).to(torch.bfloat16)
    targets = torch.randint(0, valid, (n,), device=device, generator=g)
    targets[::31] = IGNORE
    w_logp, w_ent = torch.randn(n, device=device, generator=g), torch.randn(n, device=device, generator=g)

    def fused():
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, en = fused_linear_token_logprob(hh, ww, targets, vocab_size=valid, return_entropy=True)
        ((lp * w_logp).sum() + (en * w_ent).sum()).backward()
        return lp, en, hh.grad, ww.grad

    def eager():
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lsm = torch.log_softmax((hh @ ww[:valid].t()).float(), dim=-1)
        keep = targets != IGNORE
        lp = torch.where(keep, lsm.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
        en = torch.where(keep, -(lsm.exp() * lsm).sum(-1), 0.0)
        ((lp * w_logp).sum() + (en * w_ent).sum()).backward()
        return lp, en, hh.grad, ww.grad

    out = {}
    results = {}
    for name, fn in (("fused", fused), ("eager", eager)):
        sync(device)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        results[name] = fn()
        if device == "cuda":
            out[f"{name}_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        out[f"{name}_seconds"] = median_seconds(fn, device, max(3, sz["repeats"] // 4), warmup=1)
    (lp, en, gh, gw), (elp, een, egh, egw) = results["fused"], results["eager"]
    gw_scale, gh_scale = egw.float().abs().max().item(), egh.float().abs().max().item()
    out.update(logp_err=max_abs(lp, elp), entropy_err=max_abs(en, een),
               grad_hidden_rel_err=max_abs(gh.float(), egh.float()) / gh_scale,
               grad_weight_rel_err=max_abs(gw[:valid].float(), egw[:valid].float()) / gw_scale,
               padding_rows_zero=bool((gw[valid:] == 0).all()), fused_over_eager=out["fused_seconds"] / out["eager_seconds"])
    out["ok"] = (out["logp_err"] <= 5e-3 and out["entropy_err"] <= 5e-3 and out["grad_hidden_rel_err"] <= 2e-2
                 and out["grad_weight_rel_err"] <= 2e-2 and out["padding_rows_zero"])
    out.update(weight_grad_accumulation(device, sz))
    return out


def weight_grad_accumulation(device: str, sz: dict) -> dict:
    """The fused head's per-chunk d weight += g^T h at its shape, two ways (module docstring)."""
    rows, h, vs = sz["acc_rows"], sz["fused_h"], sz["fused_vs"]
    gl = torch.randn(rows, vs, device=device).to(torch.bfloat16)
    hid = torch.randn(rows, h, device=device).to(torch.bfloat16)
    buf = torch.zeros(vs, h, device=device)
    out = {"accumulate_bf16_product_seconds": median_seconds(lambda: buf.add_(gl.t() @ hid), device, sz["repeats"])}
    try:
        out["accumulate_fp32_addmm_seconds"] = median_seconds(
            lambda: torch.addmm(buf, gl.t(), hid, out_dtype=torch.float32, out=buf), device, sz["repeats"])
        exact = torch.zeros(vs, h, device=device)
        torch.addmm(exact, gl.t(), hid, out_dtype=torch.float32, out=exact)
        ref = gl.t().float() @ hid.float()
        out["fp32_addmm_rel_err"] = max_abs(exact, ref) / ref.abs().max().item()
        out["bf16_product_rel_err"] = max_abs((gl.t() @ hid).float(), ref) / ref.abs().max().item()
    except (RuntimeError, TypeError) as err:  # out_dtype is CUDA-only (torch >= 2.8)
        out["accumulate_fp32_addmm"] = f"unavailable: {str(err).splitlines()[0][:120]}"
    return out


def check_nan_and_gae(device: str, sz: dict) -> dict:
    row = torch.tensor([[float("nan"), 1.0], [0.5, 2.0]], device=device)
    lp, en = token_logprob(row, torch.tensor([1, 1], device=device), return_entropy=True)
    T, k = 5000, 3001
    r = torch.ones(1, T, device=device)
    v = torch.full((1, T), 0.5, device=device)
    v[0, k] = float("nan")
    m = torch.ones(1, T, dtype=torch.bool, device=device)
    adv, _ = gae(r, v, m, 0.9, 0.0)
    bad = (~torch.isfinite(adv[0])).nonzero().flatten().tolist()
    ref_adv, _ = reference_gae(r.cpu(), v.cpu(), m.cpu(), 0.9, 0.0)
    out = dict(nan_row_logp=str(lp.tolist()), nan_row_entropy=str(en.tolist()), gae_nonfinite_at=bad,
               gae_err=max_abs(adv.cpu().nan_to_num(), ref_adv.nan_to_num()))
    out["ok"] = (bool(torch.isnan(lp[0]) and torch.isnan(en[0]) and torch.isfinite(lp[1]) and torch.isfinite(en[1]))
                 and bad == [k - 1, k] and out["gae_err"] <= 1e-5)
    return out


def check_roofline(device: str, sz: dict) -> dict:
    n, v, reps = sz["n"], sz["v"], sz["repeats"]
    x = (torch.randn(n, v, device=device) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device)
    gl, ge = torch.randn(n, device=device), torch.randn(n, device=device)
    bytes_read = x.numel() * x.element_size()
    t = dict(
        amax=median_seconds(lambda: x.amax(-1), device, reps),
        clone=median_seconds(lambda: x.clone(), device, reps),
        fwd=median_seconds(lambda: token_logprob(x, targets), device, reps),
        fwd_entropy=median_seconds(lambda: token_logprob(x, targets, return_entropy=True), device, reps),
    )
    _, lse, ent = torch.ops.megalign.token_logprob_fwd(x, targets, 1.0, IGNORE, True, False)
    t["bwd_entropy"] = median_seconds(
        lambda: token_logprob_shard_backward(x, targets, lse, ent, gl, ge, 0, 1.0, IGNORE), device, reps)
    hbm = float(os.environ.get("MEGALIGN_HBM_GBPS", "4800"))
    out = {f"{k}_ms": s * 1e3 for k, s in t.items()}
    for k in ("amax", "fwd", "fwd_entropy"):
        out[f"{k}_GBps"] = bytes_read / t[k] / 1e9
    for k in ("clone", "bwd_entropy"):
        out[f"{k}_GBps"] = 2 * bytes_read / t[k] / 1e9
    out.update(fwd_of_amax=t["amax"] / t["fwd"], fwd_entropy_of_amax=t["amax"] / t["fwd_entropy"],
               bwd_of_clone=t["clone"] / t["bwd_entropy"], hbm_spec_GBps=hbm,
               fwd_of_spec=out["fwd_GBps"] / hbm, fwd_entropy_of_spec=out["fwd_entropy_GBps"] / hbm,
               bwd_of_spec=out["bwd_entropy_GBps"] / hbm, ok=True)
    return out


def check_small_ops(device: str, sz: dict) -> dict:
    b, t, reps = sz["ops_rows"], sz["ops_cols"], sz["repeats"]
    g = torch.Generator(device=device).manual_seed(2)
    logp = -torch.rand(b, t, device=device, generator=g) * 3
    old = logp + 0.05 * torch.randn(b, t, device=device, generator=g)
    ref = logp + 0.1 * torch.randn(b, t, device=device, generator=g)
    adv = torch.randn(b, t, device=device, generator=g)
    mask = torch.rand(b, t, device=device, generator=g) < 0.8
    values, rewards = torch.randn(b, t, device=device, generator=g), torch.randn(b, t, device=device, generator=g)
    scores = torch.randn(b * sz["group"], device=device, generator=g)
    ids = torch.randint(0, b, (b * sz["group"],), device=device, generator=g)
    out = {}
    kl = kl_penalty_masked_mean(logp, ref, mask)
    out["kl_mean_err"] = abs(kl.item() - reference_kl_masked_mean(logp.double(), ref.double(), mask).item())
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, beta=0.01, ref_logp=ref)
    rloss, rstats = reference_policy_loss(logp.double(), old.double(), adv.double(), mask, 0.2, 0.28, None, 0.01,
                                          ref.double())
    out["policy_loss_err"] = max_abs(loss, rloss)
    out["policy_approx_kl_err"] = abs(stats.approx_kl.item() - rstats.approx_kl.item())
    a, _ = gae(rewards, values, mask, 0.99, 0.95)
    ra, _ = reference_gae(rewards.cpu(), values.cpu(), mask.cpu(), 0.99, 0.95)
    out["gae_rel_err"] = max_abs(a.cpu(), ra) / ra.abs().max().item()
    ga = group_advantages(scores, group_size=sz["group"])
    out["group_err"] = max_abs(ga, reference_group_advantages(scores.double(), group_size=sz["group"]))
    gi = group_advantages(scores, group_index=ids)
    out["group_by_id_err"] = max_abs(gi, reference_group_advantages(scores.double(), group_index=ids))
    out["kl_masked_mean_ms"] = 1e3 * median_seconds(lambda: kl_penalty_masked_mean(logp, ref, mask), device, reps)
    out["policy_loss_ms"] = 1e3 * median_seconds(
        lambda: policy_loss(logp, old, adv, mask, 0.2, 0.28, beta=0.01, ref_logp=ref), device, reps)
    out["gae_ms"] = 1e3 * median_seconds(lambda: gae(rewards, values, mask, 0.99, 0.95), device, reps)
    out["group_by_id_ms"] = 1e3 * median_seconds(lambda: group_advantages(scores, group_index=ids), device, reps)
    out["ok"] = (out["kl_mean_err"] <= 1e-6 and out["policy_loss_err"] <= 1e-5 and out["policy_approx_kl_err"] <= 1e-6
                 and out["gae_rel_err"] <= 1e-5 and out["group_err"] <= 1e-5 and out["group_by_id_err"] <= 1e-5)
    return out


CHECKS = {"token_logprob": check_token_logprob, "fused_linear": check_fused_linear, "nan_and_gae": check_nan_and_gae,
          "roofline": check_roofline, "small_ops": check_small_ops}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_probe: no CUDA device (use --device cpu to run the checks at small sizes)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    header = dict(check="setup", device=args.device, torch=torch.__version__, have_extension=ops.HAVE_EXTENSION,
                  with_cuda=ops.WITH_CUDA, gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(json.dumps(header), flush=True)
    failed = 0
    with open(os.path.join(args.out, "probe.jsonl"), "a") as log:
        log.write(json.dumps(header) + "\n")
        for name in args.only or CHECKS:
            t0 = time.perf_counter()
            try:
                result = CHECKS[name](args.device, SIZES[args.device])
            except Exception as err:  # report and go on: one GPU slot, every check counts
                result = dict(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
            result = dict(check=name, seconds=round(time.perf_counter() - t0, 3), **result)
            failed += not result["ok"]
            line = json.dumps(result, default=str)
            print(line, flush=True)
            log.write(line + "\n")
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return failed


if __name__ == "__main__":
    sys.exit(main())
