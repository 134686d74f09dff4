"""How much the quickstart's recall may vary across machines: the whole recipe rerun with other
CPU thread counts and float64 training (proxies for another CPU's rounding) and other seeds.

    PYTHONPATH=. python benchmarks/quickstart_robustness.py            # every variant, one line each
    PYTHONPATH=. python benchmarks/quickstart_robustness.py --variants threads=1 dtype=float64
"""

import argparse
import json
import tempfile
import time

import torch

from gradian_lightning.recipes.quickstart import run_quickstart

VARIANTS = ["threads=1", "threads=2", "dtype=float64", "seed=1", "seed=2"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="*", default=VARIANTS)
    args = parser.parse_args()
    for variant in args.variants:
        key, value = variant.split("=")
        threads = int(value) if key == "threads" else 2
        torch.set_num_threads(threads)
        kwargs = {"dtype": value} if key == "dtype" else {"seed": int(value)} if key == "seed" else {}
        start = time.time()
        with tempfile.TemporaryDirectory() as out:
            result = run_quickstart(out, **kwargs)
        print(
            json.dumps(
                {
                    "variant": variant,
                    "threads": threads,
                    "recall@1": round(result["recall@1"], 3),
                    "recall@10": round(result["recall@10"], 3),
                    "seconds": round(time.time() - start, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
