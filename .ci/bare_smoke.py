"""CI's bare-install stage: every command on `pip install .` with no extras, in a folder outside the clone.

Makes a tiny Llama and its tokenizer with the package's own quickstart helpers (no download), then
runs doctor, plan, index and query as a user would, and checks that each optional feature refuses
in one line naming its extra. Exits non-zero, saying which step, on the first failure.
"""

import json
import subprocess
import sys
from pathlib import Path

from gradian_lightning.data import read_jsonl
from gradian_lightning.recipes.quickstart import QUERIES, TRAIN, tiny_llama, word_tokenizer

CLONE = Path(sys.argv[1]).resolve()  # the repository, for its examples and benchmarks scripts
HERE = Path.cwd()
GRADIAN = str(Path(sys.executable).with_name("gradian"))


def run(*argv: str, expect: int = 0, cwd: Path = HERE) -> str:
    done = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != expect:
        sys.exit(
            f"bare install: {' '.join(argv[:3])} exited {done.returncode}, not {expect}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout + done.stderr


def one_line_naming(output: str, extra: str) -> None:
    assert "Traceback" not in output, output[-3000:]
    assert f'pip install "gradian-lightning[{extra}]"' in output.strip().splitlines()[-1], output[-1500:]


for extra in ("dask", "distributed", "matplotlib", "peft"):
    try:
        __import__(extra)
    except ImportError:
        continue
    sys.exit(f"bare install: {extra} is installed; this stage needs an install without extras")

train, queries = read_jsonl(TRAIN), read_jsonl(QUERIES)
tokenizer = word_tokenizer(r["prompt"] + r["completion"] for r in train + queries)
model = tiny_llama(len(tokenizer))
model.save_pretrained(HERE / "model")
tokenizer.save_pretrained(HERE / "model")
(HERE / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train[:24]))
(HERE / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in queries[:4]))
common = ["model.name_or_path=model", "index.path=index", "trainer.accelerator=cpu", "grads.batch_size=8"]

assert "| dask (query.engine=dask) | query | no |" in run(GRADIAN, "doctor")
report = json.loads(subprocess.run([GRADIAN, "doctor", "--json"], capture_output=True, text=True, check=True).stdout)
assert {b["name"]: b for b in report["backends"]}["dask (query.engine=dask)"]["reason"].endswith('[cluster]")')
assert "peak" in run(GRADIAN, "plan", "data.train=train.jsonl", *common).lower()
assert "24/24 rows written" in run(GRADIAN, "index", "data.train=train.jsonl", *common)
assert "queries ranked against 24 rows" in run(
    GRADIAN, "query", "query.data=queries.jsonl", "query.output=results.jsonl", *common
)
assert len((HERE / "results.jsonl").read_text().splitlines()) == 4
one_line_naming(run(GRADIAN, "query", "query.data=queries.jsonl", "query.engine=dask", *common, expect=2), "cluster")
one_line_naming(run(sys.executable, "-m", "benchmarks.perf.capture_overhead", "--smoke", expect=1, cwd=CLONE), "bench")
one_line_naming(run(sys.executable, "examples/finetune_and_attribute.py", "--smoke", expect=1, cwd=CLONE), "test")
print(
    "bare install: doctor, doctor --json, plan, index and query ran; dask, plots and the PEFT example refused naming their extras"
)
