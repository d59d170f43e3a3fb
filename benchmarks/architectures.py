"""The architecture matrix of docs/models.md: every family of tests/support/architectures.py (tiny
random builds from transformers' config classes, offline) through every log-prob pass and both
decoders, against a plain forward of each whole sequence, in float64.

    python benchmarks/architectures.py [--write docs/models.md]

Each cell is the largest difference, in nats, between the path's log-probs and the plain forward's
over a ragged batch of 6 completions of 3 to 16 tokens after prompts of 5 and 9 (a window of 8
tokens, so most sequences outrun it), with and without an agent's rows of several sequences; a
path that is not exact for the family is refused, and the cell says why. The decoders' cells are
their sampling log-probs, which they compute in float32 (engines/decoding.py). "gradients" is the
relative difference between the gradients of two passes over the same batch (the prompt shared,
and every sequence whole): where transformers computes in float32 inside a float64 model (its
RMSNorm layers), this is the floor of float64 mode. "LoRA" is what model.lora_target_modules=
all-linear adapts, and what model.lora_target_parameters can add. The tests of the same matrix are
tests/models/test_architectures.py. --write puts the table and its provenance in docs/models.md
between its markers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
from curves import provenance  # noqa: E402 - benchmarks/ and tests/ are not packages
from support.architectures import FAMILIES, build  # noqa: E402
from support.passes import DECODERS, PASSES, mask_of, pass_logprobs, plain_logprobs, ragged_batch, sampled  # noqa: E402

from grpokit.engines.static_decoder import static_decoding_problem  # noqa: E402
from grpokit.models.architecture import layers_of  # noqa: E402
from grpokit.models.logprobs import check_chunkable, completion_logprobs  # noqa: E402
from grpokit.models.routers import routed_choices  # noqa: E402

MARKERS = ("<!-- architectures table -->\n", "<!-- end architectures table -->")


def _cell(compute) -> str:
    try:
        return f"{compute():.0e}"
    except ValueError:
        return "refused"  # the reason is the family's, below the table


def pass_cells(model) -> list[str]:
    """Per pass: the worst difference over a batch of one sequence per row and of several (a later
    one from position 0, or after the prompt)."""
    cells = []
    for name in PASSES:
        if name == "chunked":
            try:
                check_chunkable(model)
            except ValueError:
                cells.append("refused")
                continue

        def worst(name=name):
            diffs = []
            for several, after in ((False, False), (True, False), (True, True)):
                batch = ragged_batch(several_sequences=several, after_prompt=after)
                got = pass_logprobs(model, batch, name, 0.7)
                diffs.append(((got.double() - plain_logprobs(model, batch, 0.7)).abs() * mask_of(batch)).max().item())
            return max(diffs)

        cells.append(_cell(worst))
    return cells


def decoder_cells(model) -> list[str]:
    cells = []
    for decoder in DECODERS:
        if decoder == "static" and static_decoding_problem(model.config):
            cells.append("refused")
            continue
        batch = sampled(model, decoder, 0.8)
        plain = plain_logprobs(model, batch, 0.8)
        cells.append(f"{((batch.sampling_logps.double() - plain).abs() * batch.completion_mask).max().item():.0e}")
    return cells


def gradient_floor(model) -> str:
    """Relative difference of the gradients of the shared-prompt and the whole-sequence passes."""
    batch = ragged_batch()
    firsts = [0, 3]
    grads = []
    for share in (True, False):
        if share and layers_of(model).stateful:  # its policy pass runs sequences whole (models/logprobs.py)
            return "-"
        model.zero_grad()
        logps = completion_logprobs(model, batch.prompt_ids[firsts], batch.prompt_mask[firsts], batch.completion_ids,
                                    batch.prompt_index, share_prompt=share)
        (logps * batch.completion_mask).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    return f"{((grads[0] - grads[1]).norm() / grads[1].norm()).item():.0e}"


def lora_cell(family: str) -> str:
    """What all-linear adapts (module suffixes), and the parameters lora_target_parameters can add."""
    from grpokit.models.loading import lora_modules, lora_parameters

    model = build(family)
    modules = sorted({name.split("layers.")[-1].split(".", 1)[-1] for name in lora_modules(model, "all-linear")})
    groups = sorted({m.rsplit(".", 1)[0] if "." in m else m for m in modules})
    extra = []
    for word in ("experts", "router"):
        try:
            lora_parameters(model, word)
            extra.append(word)
        except Exception:
            pass
    return ", ".join(groups) + (f"; + {', '.join(extra)}" if extra else "")


def reasons(model) -> list[str]:
    """Why each refused path is refused, for this family."""
    out = []
    problem = layers_of(model).mask_problem()
    if problem:
        out.append(f"packed rows: {problem} (an agent's rows of several sequences are split into rows of their own)")
    try:
        check_chunkable(model)
    except ValueError:
        out.append("chunked: its head does more than its output layer")
    static = static_decoding_problem(model.config)
    if static:
        out.append(f"static decoder: {static}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="the doc to put the table in (between its markers)")
    args = parser.parse_args()
    header = ["family", "brings", *PASSES, *(f"{d} decoder" for d in DECODERS), "gradients", "experts (k)",
              "LoRA all-linear adapts"]
    rows, notes = [], []
    for family, (config_class, _, brings) in FAMILIES.items():
        model = build(family)
        routed = routed_choices(model.config)
        row = [f"{family} (`{config_class}`)", brings, *pass_cells(model), *decoder_cells(model), gradient_floor(model),
               f"{routed[0]} ({routed[1]})" if routed else "-", lora_cell(family)]
        rows.append(row)
        notes += [f"- {family}: {r}" for r in reasons(model)]
        print(" | ".join(row), file=sys.stderr, flush=True)
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(r) + " |" for r in rows)])
    text = (f"Measured by `python benchmarks/architectures.py --write docs/models.md` on {provenance()}.\n\n"
            f"{table}\n\nRefused, and why:\n" + "\n".join(notes) + "\n")
    print(text)
    if args.write:
        doc = args.write.read_text()
        start, end = doc.index(MARKERS[0]) + len(MARKERS[0]), doc.index(MARKERS[1])
        args.write.write_text(doc[:start] + text + doc[end:])


if __name__ == "__main__":
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    main()
