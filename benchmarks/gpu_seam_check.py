"""The runtime seam on the GPU: stock outputs unsteered, and continuation exactness where the
kvedit attention runs the Triton kernel (CUDA tensors), sinks included (tiny gpt-oss).

For each tiny model (llama, gemma3 with sliding layers, gpt-oss with sinks), on CUDA when there
is one (else CPU, to check the script itself):
  * unsteered: a prepared model's logits equal an untouched twin's, bit for bit;
  * continuation: ``capture(prefix).logits(question)`` against a full forward of prefix +
    question (max abs difference; the kvedit attention on CUDA is the Triton kernel);
  * an edit changes the prediction, strength 0 does not.
Prints one line per model and writes ``--json``. Exit 1 if a check fails.

Usage: ``python -m benchmarks.gpu_seam_check [--json runs/seam_check.json]``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

import kvedit
from benchmarks.common import parser, write_json
from kvedit.testing import tiny_model

PREFIX = (
    "Alice's secret number is 4821. Bob's secret number is 7310. Carol's secret number is "
    "5902. Dave's secret number is 1234. Eve's secret number is 8080."
)
QUESTION = " Question: What is Carol's secret number? Answer:"


@torch.no_grad()
def check(arch: str, device: str) -> dict:
    model, tok = tiny_model(arch)
    twin, _ = tiny_model(arch)
    model, twin = model.to(device), twin.to(device)
    kvedit.prepare(model)
    ids = torch.tensor([tok(PREFIX + QUESTION)["input_ids"]], device=device)
    stock_equal = bool(torch.equal(model(input_ids=ids).logits, twin(input_ids=ids).logits))
    state = kvedit.capture(model, tok, PREFIX)
    ours = state.logits(QUESTION)
    n_q = ours.shape[0]
    full = twin(input_ids=ids).logits[0, -n_q - 1 : -1].float()
    cont_err = float((ours - full).abs().max())
    edited = kvedit.ops.emphasize(state, "Carol's secret number is 5902.", 3.0)
    zero = kvedit.ops.emphasize(state, "Carol's secret number is 5902.", 0.0)
    edit_delta = float((edited.logits(QUESTION) - ours).abs().max())
    zero_delta = float((zero.logits(QUESTION) - ours).abs().max())
    ok = stock_equal and cont_err < 1e-3 and edit_delta > 1e-3 and zero_delta < 1e-5
    return {
        "arch": arch,
        "device": device,
        "unsteered_bit_identical": stock_equal,
        "continuation_max_abs_err": cont_err,
        "edit_max_abs_change": edit_delta,
        "strength0_max_abs_change": zero_delta,
        "ok": ok,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [check(arch, device) for arch in ("llama", "gemma3", "gpt_oss")]
    for r in rows:
        print(
            f"{r['arch']:8s} {r['device']}: unsteered identical {r['unsteered_bit_identical']}, "
            f"continuation err {r['continuation_max_abs_err']:.2e}, edit change "
            f"{r['edit_max_abs_change']:.2e}, strength-0 change "
            f"{r['strength0_max_abs_change']:.2e}  {'PASS' if r['ok'] else 'FAIL'}"
        )
    write_json(args.json, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
