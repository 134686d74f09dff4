"""Issue 21: a data-dependent projection (LoGra's idea) against the random Kronecker projection at equal k,
by LDS and planted-source MRR on the LDS sets, SmolLM2-135M pretrained, with the retrained subsets
lds_grid.py left in RUNS.

    PYTHONPATH=. python benchmarks/lds_logra.py --runs /work/lds      # -> benchmarks/lds_results/logra.<kind>.json
    PYTHONPATH=. python benchmarks/lds_logra.py --report               # the table of RANKING.md

"pca": per module, P_in = the top-k eigenvectors of Σ_t x_t x_tᵀ and P_out those of Σ_t g_t g_tᵀ
(inputs and output-gradients of every token of the training rows, one statistics pass with the
summed supervised-token loss), in place of the N(0, 1/k) matrices. "random" is the product's
projection (grads.seed 0). Both index the training rows through `IndexSession` (with the same row
statistics, so every preconditioner is available) and make the query rows with the same projector,
rounded to float16 as `query_gradients` rounds them; scores come from `Index.topk`.
A prototype: the product has no option for it (see RANKING.md for why).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks.lds_grid import KINDS, RESULTS, SMOLLM2, lds_set, mrr, retrained, study_arguments
from gradian_lightning import IndexSession, IndexSpec, open_index
from gradian_lightning.config import load_config
from gradian_lightning.data import JsonlDataset, collate
from gradian_lightning.gradients.batch import gradient_mode, projected_gradients
from gradian_lightning.gradients.capture import LinearCapture
from gradian_lightning.gradients.loss import supervised_token_loss
from gradian_lightning.hub import load_model_and_tokenizer, pad_token_id
from gradian_lightning.index.layout import decode, encode
from gradian_lightning.validation.lds import linear_datamodeling_score, mean_and_standard_error

PRECONDITIONS = ("none", "diag", "fisher", "ekfac")
MAX_LEN, BATCH = 64, 8


def loader(rows: List[Dict], tokenizer) -> DataLoader:
    dataset = JsonlDataset(rows, tokenizer, MAX_LEN, source="lds")
    return DataLoader(dataset, batch_size=BATCH, collate_fn=partial(collate, pad_token_id=pad_token_id(tokenizer)))


def covariances(model, modules, rows, tokenizer) -> Dict[str, tuple]:
    """Per module (Σ_t g_t g_tᵀ [out, out], Σ_t x_t x_tᵀ [in, in]) float64 over the rows' real tokens."""
    sums = {
        n: [
            torch.zeros(m.out_features, m.out_features, dtype=torch.float64),
            torch.zeros(m.in_features, m.in_features, dtype=torch.float64),
        ]
        for n, m in modules.items()
    }
    mask: List[torch.Tensor] = []
    handles = []
    for name, module in modules.items():

        def forward(mod, args, out, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1])[mask[0]].double()
            sums[name][1] += x.T @ x

        def backward(mod, grad_in, grad_out, name=name):
            g = grad_out[0].detach().reshape(-1, grad_out[0].shape[-1])[mask[0]].double()
            sums[name][0] += g.T @ g

        handles += [module.register_forward_hook(forward), module.register_full_backward_hook(backward)]
    try:
        for batch in loader(rows, tokenizer):
            mask[:] = [batch["attention_mask"].reshape(-1).bool()]
            batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
            with torch.enable_grad():
                supervised_token_loss(model, batch).sum().backward()
            model.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return sums


def use_top_eigenvectors(projector, sums, k: int) -> None:
    """Replace each module's random (P_out, P_in) by the top-k eigenvectors of its covariances."""
    for name, (gg, xx) in sums.items():
        top = [torch.linalg.eigh(c)[1][:, -k:].T.float().contiguous() for c in (gg, xx)]
        projector._matrices[name] = (top[0], top[1])  # noqa: SLF001 (a prototype: the product has no such option)
    projector._on_device.clear()


def query_rows(model, session, rows, tokenizer) -> torch.Tensor:
    capture, out = LinearCapture(session.modules), []
    with gradient_mode(torch.device("cpu")):
        for batch in loader(rows, tokenizer):
            batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
            made, _ = projected_gradients(model, batch, capture, session.projector, contextlib.nullcontext())
            out.append(decode(encode(made, "float16"), "float16"))
    return torch.cat(out)


def run_kind(kind: str, runs: Path, k: int) -> Dict:
    train, queries, sources = lds_set(kind)
    subsets, outputs = retrained(runs, kind)
    model, tokenizer = load_model_and_tokenizer(load_config(None, [f"model.name_or_path={SMOLLM2}"]).model)
    model.eval()
    spec = IndexSpec(projection_dim=k)
    table: Dict[str, Dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for projection in ("random", "pca"):
            session = IndexSession(spec, f"{tmp}/{projection}")
            session.bind(model)
            if projection == "pca":
                use_top_eigenvectors(session.projector, covariances(model, session.modules, train, tokenizer), k)
            session.begin(len(train))
            for batch in loader(train, tokenizer):
                session.add(batch)
            session.finish()
            index, asked = open_index(f"{tmp}/{projection}"), query_rows(model, session, queries, tokenizer)
            for precondition in PRECONDITIONS:
                top = index.topk(asked, k=len(train), precondition=precondition)
                scores = np.full((len(queries), len(train)), 0.0)
                np.put_along_axis(scores, top.indices.numpy(), top.scores.double().numpy(), axis=1)
                lds, error = mean_and_standard_error(linear_datamodeling_score(scores, subsets, outputs))
                name = f"{projection}, {precondition}"
                table[name] = {"lds": lds, "lds_se": error, "mrr": mrr(scores, sources)}
                print(kind, name, table[name], f"{time.perf_counter() - started:.0f} s", flush=True)
    result = {"kind": kind, "case": "pretrained", "k": k, "rows": len(train), "queries": len(queries), "table": table}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"logra.{kind}.json").write_text(json.dumps(result, indent=1))
    return result


def report() -> str:
    lines = ["| set | projection, preconditioner | LDS ± se | MRR | worse of the two |", "|---|---|---|---|---|"]
    for kind in KINDS:
        path = RESULTS / f"logra.{kind}.json"
        if path.is_file():
            for name, row in json.loads(path.read_text())["table"].items():
                worse = min(row["lds"], row["mrr"])
                lines.append(
                    f"| {kind} | {name} | {row['lds']:+.3f} ± {row['lds_se']:.3f} | {row['mrr']:.3f} | {worse:+.3f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = study_arguments(__doc__)
    parser.add_argument("--k", type=int, default=16, help="grads.projection_dim of both projections")
    args = parser.parse_args()
    if args.report:
        print(report())
        return
    for kind in args.kinds:
        run_kind(kind, args.runs, args.k)


if __name__ == "__main__":
    main()
