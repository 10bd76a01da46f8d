"""Side-by-side measurement helpers for benchmarks/: median wall time and peak extra memory.

Time: `median_time(fn)` runs fn after warm-up and returns the median seconds of `repeats` runs;
`median_times_interleaved({name: fn})` alternates several implementations within each repeat.

Memory on CPU: `peak_memory(factory, *args)` runs in a fresh spawned process. `factory(*args)`
builds the inputs and returns a zero-argument callable; the child then resets the kernel's
peak-RSS counter (/proc/self/clear_refs), runs the callable once and reports VmHWM minus the RSS
before the run: the memory the computation needed beyond its inputs. glibc is told to serve
every allocation above 64 KiB with mmap so freed buffers leave RSS and cannot hide in the heap.
On CUDA it uses torch.cuda.max_memory_allocated in the same way. The pieces are public for
measurements inside a longer run (a trainer's step in its own loop): `in_fresh_process(fn, *args)`
runs fn in such a process and returns its result, `reset_peak_rss()` / `peak_rss_since(base)` mark
and read the high-water mark.

Side-by-side trainer benchmarks (bench_grpo_trl, bench_dpo_trl) share `build_model_dir` (the same
random Llama and char-level HF tokenizer saved for both frameworks), `trl_available` and `quiet`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_times_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5,
                             warmup: int = 1) -> dict[str, float]:
    """Median seconds of each fn, running them in turn each repeat (a, b, a, b, ...), so a change in
    the machine's load during the run hits every implementation alike."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's peak-RSS counter (VmHWM := VmRSS) and return the RSS now, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss_since(base: int) -> int:
    """Bytes the RSS rose to above `base` (a `reset_peak_rss` value) since that reset."""
    return _status_kib("VmHWM") * 1024 - base


def _measure(factory, args, device):
    run = factory(*args)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = reset_peak_rss()
    run()
    return peak_rss_since(base)


def _child(queue, fn, args):
    try:
        queue.put(fn(*args))
    except BaseException as exc:  # report to the parent instead of hanging it
        queue.put(exc)


def in_fresh_process(fn: Callable, *args):
    """`fn(*args)` in a freshly spawned process (fn and args picklable), with glibc's mmap threshold at
    64 KiB (module doc); returns its result or raises its exception."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, fn, args))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def peak_memory(factory: Callable, *args, device: str = "cpu") -> int:
    """Bytes of memory `factory(*args)()` needed beyond its inputs, measured in a fresh process."""
    return int(in_fresh_process(_measure, factory, args, device))


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 / AVX2 (from /proc/cpuinfo)."""
    name, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)  # the last CPU's fields
        name = info.get("model name\t", name).strip()
        flags = set(info.get("flags\t\t", "").split())
    except OSError:
        pass
    units = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{name} ({units})"


def machine_line() -> str:
    """One line naming what a CPU benchmark ran on: CPU, the megalign kernels' vector ISA, torch."""
    from megalign.ops import _backend

    isa = _backend._C.cpu_isa() if _backend.HAVE_EXTENSION else "none (references)"
    return (f"CPU: {cpu_model()}; megalign CPU kernels: {isa}; torch {torch.__version__} "
            f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")


SPECIALS = ("<pad>", "<bos>", "<eos>")
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def build_model_dir(path: str, vocab_size: int) -> None:
    """Random 4-layer Llama and a char-level PreTrainedTokenizerFast, saved together in `path`.

    The tokenizer encodes printable ASCII one character a token; `vocab_size` above the 99 real
    tokens is filled with placeholder words `<tN>` that encoding never produces but a random model
    may sample (they decode to their own text), to give the model a realistic LM-head size.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    tokens = SPECIALS + tuple(chars)
    tokens += tuple(f"<t{i}>" for i in range(len(tokens), vocab_size))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def trl_available() -> str | None:
    """TRL's version, or None when it is not installed."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def quiet():
    """Silence the frameworks' info logs and warnings, so a benchmark prints only its table."""
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("megalign", "transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Row:
    """One measured implementation of one case; ratios are relative to megalign in the same case."""

    op: str
    case: str
    impl: str
    seconds: float
    peak_bytes: int | None = None


def print_report(header: str, rows: list[Row], lines: list[str], seconds: float, json_path: str | None) -> None:
    """Print a side-by-side benchmark's header, table (`format_table`), summary lines and run time; with
    `json_path`, also write the rows and lines there."""
    print(header)
    print(format_table(rows))
    print()
    print("\n".join(lines))
    print(f"\n({seconds:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": [dataclasses.asdict(r) for r in rows], "lines": lines}, f, indent=1)


def format_table(rows: list[Row], ours: str = "megalign") -> str:
    """Markdown table with time and memory ratios of each peer over megalign (higher = megalign wins)."""
    base = {(r.op, r.case): r for r in rows if r.impl == ours}
    out = ["| op | case | impl | time (ms) | time / megalign | peak extra (MiB) | mem / megalign |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get((r.op, r.case))
        t_ratio = f"{r.seconds / b.seconds:.2f}x" if b else "-"
        mem = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
        if b and r.peak_bytes is not None and b.peak_bytes:
            m_ratio = f"{r.peak_bytes / b.peak_bytes:.2f}x"
        else:
            m_ratio = "-"
        out.append(f"| {r.op} | {r.case} | {r.impl} | {r.seconds * 1e3:.2f} | {t_ratio} | {mem} | {m_ratio} |")
    return "\n".join(out)
