"""A model folder with random weights: the negative control of the validation
chain (issue 15; bench/validation_chain.py, tests/core/test_validate.py).

``python -m core.zoo.random_weights --model shapes-llava --out DIR [--seed 0]``
copies a safetensors model folder (config, tokenizer, processor) and replaces
every floating-point tensor of its weights by seeded Gaussian noise of the
same shape, mean and standard deviation (a constant tensor, such as a norm's
unit gain, stays as it is). The scale of each tensor is kept, so activations
have their trained magnitudes; what is destroyed is every learned direction.
A label the chain "supports" on such a model would be an artefact of the
method. The folder's ``MANIFEST.sha256`` is rewritten for the new weights;
the model card, evaluations and tuned lenses are not copied (they describe
the trained weights).
"""

from __future__ import annotations

import shutil
import sys
import zlib
from pathlib import Path

from core.errors import ReadoutError
from core.shell.arguments import Parser, seed_int

# what describes the trained weights (their card, evaluations, training log, tuned lenses) is not copied
SKIPPED = ("CARD.md", "MANIFEST.sha256", "tuned-lens", "training.json")
SKIPPED_PREFIXES = ("eval_", "learning_curve")


def _noise_like(tensor, seed: int, name: str):
    import torch

    if not tensor.is_floating_point() or tensor.numel() < 2:
        return tensor
    t = tensor.double()
    std = float(t.std())
    if std == 0.0:
        return tensor
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    noise = torch.randn(tensor.shape, generator=g, dtype=torch.float64)
    return (noise * std + float(t.mean())).to(tensor.dtype)


def randomize_folder(source: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Copy the model folder ``source`` (a built-in name or a path) to ``out``
    with every ``*.safetensors`` weight file replaced by std-matched noise."""
    from safetensors.torch import load_file, save_file

    from core.files.atomic import make_folder
    from core.models.loading import resources_dir
    from core.models.model_files import write_manifest

    src = Path(source)
    if not src.is_dir():
        src = resources_dir() / "models" / str(source)
    if not src.is_dir():
        raise ReadoutError(f"{source}: no such model folder or built-in model")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ReadoutError(f"{out}: exists and is not empty; give a new folder")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ReadoutError(f"{src}: no *.safetensors weights to randomize")
    make_folder(out)
    for f in sorted(src.iterdir()):
        if f.name in SKIPPED or f.name.startswith(SKIPPED_PREFIXES) or f.suffix == ".safetensors" or f.is_dir():
            continue
        shutil.copy2(f, out / f.name)
    for f in weights:
        tensors = load_file(str(f))
        save_file({k: _noise_like(v, seed, k).contiguous() for k, v in tensors.items()}, str(out / f.name))
    write_manifest(out)
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m core.zoo.random_weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="built-in model name or model folder (safetensors weights)")
    p.add_argument("--out", required=True, help="new folder for the copy")
    p.add_argument("--seed", type=seed_int, default=0)
    args = p.parse_args(argv)
    try:
        print(randomize_folder(args.model, args.out, args.seed))
    except (ReadoutError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
