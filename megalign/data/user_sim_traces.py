"""SFT traces and prompt rows for the embedded `user_sim` demonstration (issue 28): dialogues with the simulated
user `ArithmeticUser` (`megalign.envs.user_sim`), who wants the sum of three numbers and reveals one per message.

Each trace is a scripted assistant's side of the dialogue in the think-then-say format, with its running total
in the thinking part:

    user       "Add up my numbers; I will tell you one at a time. First: 7."
    assistant  "<think>7</think>Go on."                     (or, impatient, "<think>7</think>answer: 7")
    user       "Next: 12."                                   (after an impatient answer: "Wait, there is more. Next: 12.")
    assistant  "<think>7+12=19</think>Go on."               (or "<think>7+12=19</think>answer: 19")
    user       "Last: 9."
    assistant  "<think>19+9=28</think>answer: 28"

Design choices:

- The scripted assistant is impatient: before the last number it answers with its running total with
  probability `impatience` (default 0.7, a seeded draw per turn), as a model that has not learned the user's
  pacing would. Its sums are always right and its format always kept, so the SFT policy learns the format, the
  running sums and the dialogue's flow from the traces, and inherits the impatience; what GRPO can learn from the
  user's score alone is to wait for the last number (a premature answer costs `premature_penalty`) and to add
  correctly (a wrong final answer costs `wrong_penalty` and a retry). Nothing in the traces shows which habit
  the user rewards.
- Built by driving the real environment, like the tool traces (`megalign.data.tool_traces`): the user's messages
  are `ArithmeticUser`'s own (with its default penalties: an early answer costs 20, so a dialogue with two early
  answers still reaches the last number; examples/grpo_user_sim.yaml's user is stricter, and the user's text does
  not depend on the penalties), each trace must end with the user done and satisfied (`solved`), and each is
  checked byte for byte against the multi-turn rollout's layout of the same conversation
  (`check_byte_identical`), so SFT trains on exactly the ids a GRPO episode holds.
- Rows: `numbers` drawn uniformly from [min_value, max_value] (default 1..15: sums a character-level model of the
  embedded size gets mostly right, so answering stays worth more than stalling until the episode's token limit,
  which the user scores at the emotion reached), `count` of them, seeded; distinct number tuples;
  the first `held_out` rows drawn are held out, never traced. Prompt rows carry `prompt` (the user's first
  message, which the environment writes again itself), `answer` (the sum), `numbers` and `op` (which reach the
  environment as the row's metadata).

Files (`out_dir`): `user_sim_traces_train.jsonl` (the chats, with `answer`), `user_sim_train.jsonl` and
`user_sim_held_out.jsonl` (prompt rows of GRPO and of the comparison).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Optional

from megalign.config import atomic_write_text, option
from megalign.data.tool_traces import check_byte_identical


@dataclasses.dataclass
class UserSimTracesConfig:
    """The task and the scripted assistant of `write_user_sim_traces` (module doc)."""

    out_dir: str = option("runs/user_sim_data", doc="folder of the traces and the prompt files")
    num_rows: int = option(3000, doc="distinct number tuples drawn")
    held_out: int = option(300, doc="the first N rows drawn are held out (GRPO's eval and the comparison)")
    count: int = option(3, doc="numbers per dialogue (the user reveals one per message)")
    min_value: int = option(1, doc="smallest number")
    max_value: int = option(15, doc="largest number")
    impatience: float = option(0.7, doc="probability that the scripted assistant answers its running total before "
                                        "the last number, per turn")
    seed: int = option(0, doc="seed of the rows and of the impatience draws")
    max_traces: Optional[int] = option(None, doc="traces of the first N training rows; null: all")
    tokenizer_path: Optional[str] = option(None, doc="HF folder of the policy's tokenizer the byte-identity check "
                                                     "uses; null: the built-in character tokenizer")
    device: str = option("cpu", doc="the launch's process group (the files are written on the host either way)")

    def __post_init__(self):
        if self.count < 2:
            raise ValueError(f"count must be >= 2 (one number leaves nothing to wait for), got {self.count}")
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {self.min_value}, {self.max_value}")
        if not 0.0 <= self.impatience <= 1.0:
            raise ValueError(f"impatience must be in [0, 1], got {self.impatience}")
        if not 0 < self.held_out < self.num_rows:
            raise ValueError(f"held_out must be in (0, num_rows={self.num_rows}), got {self.held_out}")
        if (self.max_value - self.min_value + 1) ** self.count < self.num_rows:
            raise ValueError(f"num_rows={self.num_rows} is more than the {(self.max_value - self.min_value + 1) ** self.count} "
                             f"distinct tuples of {self.count} numbers in [{self.min_value}, {self.max_value}]")
        if self.max_traces is not None and self.max_traces < 1:
            raise ValueError(f"max_traces must be >= 1 or null, got {self.max_traces}")


def draw_rows(cfg: UserSimTracesConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) prompt rows (module doc): distinct tuples in draw order, the first `held_out` held out."""
    from megalign.envs.user_sim import ArithmeticUser

    rng, seen, rows = random.Random(cfg.seed), set(), []
    while len(rows) < cfg.num_rows:
        numbers = tuple(rng.randint(cfg.min_value, cfg.max_value) for _ in range(cfg.count))
        if numbers in seen:
            continue
        seen.add(numbers)
        user = ArithmeticUser()
        first = user.reset({"numbers": list(numbers), "op": "+"}, seed=0)
        rows.append({"prompt": first[0]["content"], "answer": user.goal, "numbers": list(numbers), "op": "+"})
    return rows[cfg.held_out:], rows[:cfg.held_out]


def assistant_turn(numbers: list[int], known: int, answer: bool) -> str:
    """The scripted assistant's reply once it knows the first `known` numbers: the running total's last addition
    in the thinking part, then `answer: total` or "Go on."."""
    total = sum(numbers[:known])
    thought = str(numbers[0]) if known == 1 else f"{total - numbers[known - 1]}+{numbers[known - 1]}={total}"
    return f"<think>{thought}</think>" + (f"answer: {total}" if answer else "Go on.")


def trace_messages(row: dict, rng: random.Random, impatience: float, env=None) -> list[dict]:
    """The dialogue of one row between the scripted assistant and `env` (default: a fresh `ArithmeticUser`), built
    by driving it (module doc); ValueError naming the row unless the user ends it satisfied."""
    from megalign.envs.user_sim import ArithmeticUser

    env = env or ArithmeticUser()
    numbers = row["numbers"]
    conversation = [dict(m) for m in env.reset(row, seed=0)]
    for known in range(1, len(numbers) + 1):
        last = known == len(numbers)
        turn = assistant_turn(numbers, known, answer=last or rng.random() < impatience)
        result = env.step([dict(m) for m in conversation], turn)
        conversation.append({"role": "assistant", "content": turn})
        if result.done != last or (last and not result.info.get("solved")):
            raise ValueError(f"row {numbers}: the simulated user {'ended' if result.done else 'went on with'} the "
                             f"dialogue after {turn!r} (info={result.info}, score {env.score})")
        conversation += [dict(m) for m in result.observation]
    return conversation


def write_user_sim_traces(cfg: UserSimTracesConfig) -> dict[str, int]:
    """Write the traces and prompt files (module doc) and return the counts (premature answers among them)."""
    from megalign.data.tokenizer import CharTokenizer, HFTokenizer

    tokenizer = CharTokenizer() if cfg.tokenizer_path is None else HFTokenizer(cfg.tokenizer_path)
    train, held_out = draw_rows(cfg)
    rng = random.Random(cfg.seed + 1)
    rows, premature = [], 0
    for row in train if cfg.max_traces is None else train[:cfg.max_traces]:
        messages = trace_messages(row, rng, cfg.impatience)
        check_byte_identical(messages, tokenizer)
        premature += sum(m["role"] == "assistant" and "answer:" in m["content"] for m in messages[:-1])
        rows.append({"messages": messages, "answer": row["answer"]})
    os.makedirs(cfg.out_dir, exist_ok=True)
    for name, out in (("user_sim_traces_train", rows), ("user_sim_train", train), ("user_sim_held_out", held_out)):
        atomic_write_text(os.path.join(cfg.out_dir, f"{name}.jsonl"), "".join(json.dumps(r) + "\n" for r in out))
    counts = {"traces": len(rows), "premature_answers": premature, "train_prompts": len(train),
              "held_out_prompts": len(held_out)}
    print(json.dumps({"out_dir": cfg.out_dir, **counts}), flush=True)
    return counts
