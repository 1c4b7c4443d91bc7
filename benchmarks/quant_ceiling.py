"""What each weight format can reach on SmolLM2, measured in PyTorch alone (no ONNX, no moeforge graph code).

`python benchmarks/quant_ceiling.py` fake-quantises SmolLM2's weights in PyTorch (round to the format's grid,
dequantise back to fp32) and reports teacher-forced top-1 agreement and mean KL against the fp32 model over
tests/data/quant_eval_en.txt -- the same text and metric as benchmarks/quant_accuracy.py. It separates what
a format can reach on this checkpoint from what our graphs and kernels add, and shows why: SmolLM2's GGUF
stores the layers as Q4_1 (asymmetric 4-bit blocks of 32), so min-max asymmetric int4 blocks reproduce them
exactly while symmetric 8-bit grids re-round them; and 8% of positions on this text have a top-2 probability
gap under 1%, so even bf16 weights move top-1 (the 99% bar is about bf16 fidelity).
Writes benchmarks/results/quant_ceiling_smollm2.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moeforge.cli.bench import write_result
from moeforge.model.loader import load_model

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "quant_eval_en.txt"
RESULTS = Path(__file__).resolve().parent / "results" / "quant_ceiling_smollm2.json"


def symmetric(w: torch.Tensor, bits: int, block: int | None) -> torch.Tensor:
    """Symmetric round-to-nearest; per output channel (block None) or in blocks along K. w: [out, in]."""
    out_dim, in_dim = w.shape
    qmax = 2 ** (bits - 1) - 1
    blocks = w.reshape(out_dim, 1 if block is None else in_dim // block, -1)
    scale = blocks.abs().amax(2, keepdim=True).clamp(min=1e-12) / qmax
    return ((blocks / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(out_dim, in_dim)


def asymmetric(w: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Min-max asymmetric blocks with a float zero point (what MatMulNBits' float zero_points express)."""
    out_dim, in_dim = w.shape
    blocks = w.reshape(out_dim, in_dim // block, block)
    low, high = blocks.amin(2, keepdim=True), blocks.amax(2, keepdim=True)
    scale = (high - low).clamp(min=1e-12) / (2**bits - 1)
    return (((blocks - low) / scale).round().clamp(0, 2**bits - 1) * scale + low).reshape(out_dim, in_dim)


def main() -> None:
    loaded = load_model("smollm2-135m")
    model = loaded.model.eval()
    ids = torch.tensor([loaded.tokenizer.encode(TEXT.read_text())])
    positions = torch.arange(ids.shape[1])[None]
    original = {name: p.detach().clone() for name, p in model.named_parameters()}

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(ids, positions).logits[0].float()

    reference = logits()
    probs = reference.softmax(-1).topk(2, -1).values
    close_calls = float((probs[:, 0] - probs[:, 1] < 0.01).float().mean())

    def measure(layers: Callable[[torch.Tensor], torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor]):
        for name, p in model.named_parameters():
            source = original[name]
            p.data.copy_(source if p.dim() != 2 else (head(source) if "embed" in name else layers(source)))
        out = logits()
        agree = float((out.argmax(-1) == reference.argmax(-1)).float().mean())
        kl = float(torch.nn.functional.kl_div(out.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                              reduction="batchmean"))
        return {"top1_agreement": round(agree, 4), "mean_kl": kl}

    keep = lambda w: w  # noqa: E731
    schemes = {
        "fp16 weights": (lambda w: w.half().float(), lambda w: w.half().float()),
        "bf16 weights": (lambda w: w.bfloat16().float(), lambda w: w.bfloat16().float()),
        "int8 per channel (head fp32)": (lambda w: symmetric(w, 8, None), keep),
        "int8 per channel (head int8 per channel)": (lambda w: symmetric(w, 8, None), lambda w: symmetric(w, 8, None)),
        "int8 blocks of 32 (head int8 b32)": (lambda w: symmetric(w, 8, 32), lambda w: symmetric(w, 8, 32)),
        "int4 symmetric blocks of 32 (head int8 b32)": (lambda w: symmetric(w, 4, 32), lambda w: symmetric(w, 8, 32)),
        "int4 min-max asymmetric blocks of 32, float zero point (head int8 b32)":
            (lambda w: asymmetric(w, 4, 32), lambda w: symmetric(w, 8, 32)),
    }
    rows = {}
    for label, (layers, head) in schemes.items():
        rows[label] = measure(layers, head)
        print(f"{label}: {rows[label]}", flush=True)
    write_result(RESULTS, "quant_ceiling", {
        "model": "smollm2-135m", "reference": "PyTorch fp32", "text": str(TEXT.relative_to(ROOT)),
        "tokens": int(ids.shape[1]), "positions_with_top2_gap_below_0.01": round(close_calls, 4),
        "method": "PyTorch fake quantisation of every 2-D weight (layers; the tied embedding/LM head separately)",
        "schemes": rows,
    })


if __name__ == "__main__":
    main()
