"""Data and model errors through `launch/train.py` on 2 ranks end in one line per rank, as config errors do (issue 32
item 10): no traceback of ours unless `--debug`. A config.json that cannot be used (a required key missing) was a
KeyError traceback from every rank, raised while sizing the checkpoint before any model check ran.
"""
import json
import os
import subprocess
import sys

import pytest

from megalign.models.config import HFConfigError, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=2")


def torchrun_train(*args, cwd):
    """`torchrun --nproc-per-node 2 launch/train.py *args`: (exit status, our ranks' stderr lines)."""
    env = {k: v for k, v in os.environ.items() if k != "MEGALIGN_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           os.path.join(ROOT, "launch", "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def ours(stderr):
    """The distinct lines the ranks wrote, without torchrun's own report of the failed child (its agent's W/E lines
    and its ChildFailedError traceback, which every failing torchrun job prints). One set: the first rank to exit
    makes torchrun stop the other, which may be stopped before it prints its line."""
    return {line for line in stderr.splitlines() if line.startswith(("error:", "[rank"))}


def test_data_error_is_one_line_per_rank(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": 3}\n')
    status, err = torchrun_train("algorithm=sft", f"data.path={data}", "device=cpu", "steps=1",
                                 f"run_dir={tmp_path / 'run'}", *TINY, cwd=tmp_path)
    line = f"error: {data}:2: 'prompt' must be a non-empty string, got 3 (set skip_invalid to skip and count such rows)"
    assert status != 0 and ours(err) == {line}, err
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err


def test_a_config_json_without_a_required_key_is_one_line_per_rank_naming_file_and_key(tmp_path):
    data = tmp_path / "ok.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    status, err = torchrun_train("algorithm=sft", f"data.path={data}", f"model.path={model}", "device=cpu",
                                 "steps=1", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    line = f"error: {model / 'config.json'}: required key 'num_attention_heads' is missing"
    assert status != 0 and ours(err) == {line}, err
    assert "KeyError" not in err, err


@pytest.mark.parametrize("content, message", [
    ("{not json", r"config.json: cannot be read as an HF config.json: Expecting property name"),
    ("[1, 2]", r"config.json: an HF config.json holds a JSON object, got list"),
    (json.dumps({"model_type": "gpt2"}), r"config.json: model_type 'gpt2' is not supported"),
    (json.dumps({"model_type": "llama", "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 10,
                 "intermediate_size": 16}), r"config.json: required key 'num_hidden_layers' is missing"),
])
def test_from_hf_names_the_file_and_what_is_wrong(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(HFConfigError, match=message):
        ModelConfig.from_hf(tmp_path)
