"""Pipeline rollout on 2 CPU processes: `pipeline_rollout` at pp=2 vs `rollout` at pp=1 (dp=2) vs the old `pipeline_generate`.

    python benchmarks/bench_pipeline_rollout.py [--quick] [--repeats K] [--layers L --hidden H] [--split A,B]
        [--prompts U --group G --max-new R]

Two gloo processes (mp spawn, one torch thread each), the same random Llama as bench_rollout.py (vocab
32000, fp32; default 8 layers, hidden 256) and its prompts (random, 16-64 tokens, left-padded), U=8
prompts x G=4 samples, up to R=64 new tokens at temperature 1 (`--quick`: U=4, R=32).

Sides, all on the same 2 processes:
- `pipeline_rollout m=M`: pp=2, each process one stage (`stage_from_pretrained`, layers split evenly or by
  `--split`), M micro-batches in flight.
- `rollout dp=2` (the pp=1 reference): each process holds the whole model and rolls out half of the
  prompts with the engine. This is the fair pp=1 comparison: the same 2 processes and cores do the same
  FLOPs with the same engine, nothing is split; one process alone would leave a core idle.
- `pipeline_generate`: the old stage-after-stage loop over the U*G repeated rows (pp=2).

Cases: `fixed` (no EOS: every row generates R tokens; all sides) and `long-tail` (bench_rollout's length
schedule forced by its `ForcedLengths` processor, mean about R/4; not the old loop, which takes no processor).
Timing: a barrier, the rollout, a barrier; the median over `--repeats` rounds with the sides alternating.
tok/s = generated tokens of both processes / seconds. Bubble = time a stage spent blocked in receives /
its rollout time (`RolloutStats.recv_wait_s`; for `pipeline_generate`, time in its `dist.recv` and token
`dist.broadcast`, timed by wrapping them), per stage, from the median round.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_rollout import EOS, PAD, ForcedLengths, build, length_schedule, prompts  # noqa: E402
from harness import machine_line  # noqa: E402

from megalign.models import from_pretrained, stage_from_pretrained  # noqa: E402
from megalign.parallel import ParallelLayout  # noqa: E402
from megalign.rollout import EngineConfig, SamplingParams, pipeline_generate, pipeline_rollout, rollout  # noqa: E402


@contextlib.contextmanager
def timed_waits(clock: list):
    """Add the seconds spent in `dist.recv` / `dist.broadcast` to clock[0] while active (the old loop's waits)."""
    originals = dist.recv, dist.broadcast

    def wrap(fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - t0
        return timed
    dist.recv, dist.broadcast = (wrap(f) for f in originals)
    try:
        yield
    finally:
        dist.recv, dist.broadcast = originals


def sides(path, args, ids, mask, group, max_new, lengths):
    """{name: () -> (generated tokens on this process, wait seconds)} for this rank; collective."""
    rank = dist.get_rank()
    pp_layout = ParallelLayout.build(pp=2)
    split = [int(x) for x in args.split.split(",")] if args.split else None
    stage = stage_from_pretrained(path, pp_layout, split=split).eval()
    dense = from_pretrained(path).eval()
    width, u = ids.shape[1], ids.shape[0]
    processor = ForcedLengths(lengths) if lengths is not None else None
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, eos_token_id=EOS if lengths is not None else None,
                            pad_token_id=PAD)
    half = slice(rank * u // 2, (rank + 1) * u // 2)
    mine = ForcedLengths(lengths[half.start * group:half.stop * group]) if lengths is not None else None

    def pipelined(m):
        def run():
            out, stats = pipeline_rollout(stage, ids, mask, group, params, 0, pp_layout,
                                          config=EngineConfig(pp_microbatches=m), logits_processor=processor)
            return int(out.attention_mask[:, width:].sum()) * (rank == 0), stats.recv_wait_s
        return run

    def dp():
        out, _ = rollout(dense, ids[half], mask[half], group, params, seed=rank, logits_processor=mine)
        return int(out.attention_mask[:, width:].sum()), 0.0

    def old():
        clock = [0.0]
        with timed_waits(clock):
            out = pipeline_generate(stage, ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0), params,
                                    pp_layout, torch.Generator().manual_seed(0))
        return int(out.attention_mask[:, width:].sum()) * (rank == 0), clock[0]

    fns = {f"pipeline_rollout m={m}": pipelined(m) for m in (2, 4)}
    fns["rollout dp=2 (pp=1)"] = dp
    if lengths is None:
        fns["pipeline_generate (old)"] = old
    return fns


def worker(rank, tmp, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1800))
    u, group, max_new = (4, 4, 32) if args.quick else (8, 4, 64)
    u, group, max_new = args.prompts or u, args.group or group, args.max_new or max_new
    ids, mask = prompts(u, 16, 64, seed=1)
    report = {}
    for case, lengths in (("fixed", None), ("long-tail", length_schedule(u * group, max_new, seed=2))):
        fns = sides(f"{tmp}/model", args, ids, mask, group, max_new, lengths)
        for fn in fns.values():  # warm-up
            fn()
        rounds = {name: [] for name in fns}
        for r in range(args.repeats):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                tokens, wait = fns[name]()
                dist.barrier()
                rounds[name].append((time.perf_counter() - t0, tokens, wait))
        for name, runs in rounds.items():
            seconds, tokens, wait = sorted(runs)[len(runs) // 2]
            gathered = [None, None]
            dist.all_gather_object(gathered, (tokens, wait))
            report[(case, name)] = (seconds, sum(t for t, _ in gathered), [w / seconds for _, w in gathered])
    if rank == 0:
        results.update(report)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="U=4 prompts, R=32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompts", type=int, help="U (default 8, quick 4)")
    parser.add_argument("--group", type=int, help="G (default 4)")
    parser.add_argument("--max-new", type=int, help="R (default 64, quick 32)")
    parser.add_argument("--split", help="layers per stage, e.g. 5,3 (default: even)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        build(f"{tmp}/model", args.layers, args.hidden)
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(tmp, args, results), nprocs=2, join=True)
            results = dict(results)
    print(machine_line().replace(f"{torch.get_num_threads()} threads", "1 thread per process, 2 processes"))
    u, group, max_new = (4, 4, 32) if args.quick else (8, 4, 64)
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab 32000, split {args.split or 'even'}; "
          f"U={args.prompts or u} x G={args.group or group}, R={args.max_new or max_new}")
    print("| case | side | s | generated tok/s | vs rollout dp=2 | bubble stage 0 / stage 1 |")
    print("|---|---|---:|---:|---:|---|")
    for (case, name), (seconds, tokens, bubbles) in results.items():
        ref_s, ref_tokens, _ = results[(case, "rollout dp=2 (pp=1)")]
        ratio = (tokens / seconds) / (ref_tokens / ref_s)
        bubble = " / ".join(f"{b:.0%}" for b in bubbles) if "dp=2" not in name else "-"
        print(f"| {case} | {name} | {seconds:.2f} | {tokens / seconds:.0f} | {ratio:.2f}x | {bubble} |")
    print(f"\n({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
