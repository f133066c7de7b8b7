"""Write the seed corpora of the file-reader fuzzers (tests/fuzz/corpus/generation,
lens and pairs): small files, well-formed and hostile, of each class the
readers refuse. Re-run after changing it; the inputs the fuzzers found live
beside them as ``crash-*`` / ``timeout-*`` and are kept.

    .venv/bin/python tests/fuzz/reader_corpus.py
"""

from __future__ import annotations

import codecs
import copy
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CORPORA = Path(__file__).parent / "corpus"


def _json(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def generation_seeds() -> dict[str, bytes]:
    """A real 3-token generation of shapes-llava (the harness's question and
    image) and one hostile variant per class the reader refuses."""
    from core import load_model
    from core.files.images import image_sha256, load_image
    from core.generate import generate
    from core.models.loading import resources_dir
    from tests.fuzz.fuzz_generation import IMAGE, QUESTION

    loaded = load_model("shapes-llava")
    image = load_image(resources_dir() / "samples" / IMAGE)
    g = generate(loaded, image, QUESTION, max_new_tokens=3, top_k=2)
    g.image_sha256 = image_sha256(image)
    good = json.loads(json.dumps(g.to_dict()))
    good["model"] = {k: good["model"][k] for k in ("spec", "fingerprint")}  # what the reader reads, kept small

    def variant(edit) -> bytes:
        doc = copy.deepcopy(good)
        edit(doc)
        return _json(doc)

    image_id = next(i for i, s in loaded.adapter.markup.ids.items() if s in loaded.adapter.markup.placeholders)
    return {
        "good.json": _json(good),
        "eos.json": variant(
            lambda d: d.update(stop_reason="eos", stop_token={"token_id": 2, "token": "</s>", "prob": 0.5, "top": []})
        ),
        "negative-id.json": variant(lambda d: d["token_ids"].__setitem__(0, -1)),
        "huge-id.json": variant(lambda d: d["token_ids"].__setitem__(0, 10**30)),
        "out-of-vocabulary.json": variant(lambda d: d["token_ids"].__setitem__(1, 4096)),
        "image-token.json": variant(lambda d: d["token_ids"].__setitem__(1, image_id)),
        "markup.json": variant(lambda d: d["token_ids"].__setitem__(0, 1)),
        "tokens-mismatch.json": variant(lambda d: d["tokens"].__setitem__(0, "forged")),
        "text-mismatch.json": variant(lambda d: d.update(text="forged")),
        "model-string.json": variant(lambda d: d.update(model="shapes-llava")),
        "other-question.json": variant(lambda d: d["input"].update(question="is it red?")),
        "other-image.json": variant(lambda d: d["input"].update(image_sha256="0" * 64)),
        "nested.json": b'{"kind":"generate","token_ids":' + b"[" * 2000 + b"]" * 2000 + b"}",
        "nan.json": b'{"kind":"generate","probs":[NaN]}',
        "utf16.json": _json({"kind": "generate"}).decode().encode("utf-16"),
        "not-an-object.json": b"[1,2,3]",
    }


def lens_seeds() -> dict[str, bytes]:
    """Tiny lens folders of each form (2 blocks of width 4) saved by save_lens,
    and hostile variants: numbers out of range, int64 tensors, shapes that
    disagree with the config, a lying header, deep nesting."""
    import torch
    from safetensors.torch import save

    from core.methods.tuned_lens.lens import TunedLens
    from core.methods.tuned_lens.store import LENS_CONFIG, LENS_TENSORS, save_lens
    from tests.fuzz.fuzz_lens import pack

    def saved(form: str, **kwargs) -> tuple[dict, bytes]:
        lens = TunedLens(2, 4, form, **kwargs)
        lens.meta = {"fingerprint": "0123456789abcdef", "spec": "fuzz", "block_names": ["L0", "L1"]}
        lens.training_info = {"config": {"positions": "all"}, "data": {}}
        with tempfile.TemporaryDirectory() as folder:
            save_lens(lens, folder)
            config = json.loads((Path(folder) / LENS_CONFIG).read_text())
            return config, (Path(folder) / LENS_TENSORS).read_bytes()

    seeds = {}
    for form, kwargs in (("identity", {}), ("affine", {}), ("lowrank", {"rank": 2}), ("mlp", {"hidden": 3})):
        config, tensors = saved(form, **kwargs)
        config.pop("capacity"), config.pop("report")  # free text the loader does not read: smaller seeds
        seeds[f"{form}.lens"] = pack(_json(config), tensors)
    config, tensors = saved("affine")
    config.pop("capacity"), config.pop("report")

    def variant(edit, tensors_bytes: bytes = tensors) -> bytes:
        doc = copy.deepcopy(config)
        edit(doc)
        return pack(_json(doc), tensors_bytes)

    tr = "translator"
    floats = {
        "A": torch.zeros(2, 4, 4),
        "b": torch.zeros(2, 4),
        "mean": torch.zeros(3, 4),
    }
    seeds.update(
        {
            "n-blocks-negative.lens": variant(lambda c: c[tr].update(n_blocks=-2)),
            "n-blocks-huge.lens": variant(lambda c: c[tr].update(n_blocks=10**9)),
            "d-model-float.lens": variant(lambda c: c[tr].update(d_model=1e9)),
            "d-model-at-bound.lens": variant(lambda c: c[tr].update(d_model=2**17, n_blocks=4096)),
            "dtype-int64.lens": variant(lambda c: c[tr].update(dtype="int64")),
            "int64-tensors.lens": variant(
                lambda c: None, save({**floats, "A": torch.zeros(2, 4, 4, dtype=torch.int64)})
            ),
            "wrong-shape.lens": variant(lambda c: None, save({**floats, "mean": torch.zeros(2, 4)})),
            "nan-tensor.lens": variant(lambda c: None, save({**floats, "b": torch.full((2, 4), float("nan"))})),
            "lying-header.lens": variant(lambda c: None, tensors[:8] + tensors[8:].replace(b"[2,4,4]", b"[9,9,9]", 1)),
            "truncated.lens": variant(lambda c: None, tensors[: len(tensors) // 2]),
            "nested.lens": pack(b"[" * 3000 + b"]" * 3000, tensors),
            "translator-string.lens": variant(lambda c: c.update(translator="affine")),
            "tensors-outside.lens": variant(lambda c: c.update(tensors="../lens.safetensors")),
        }
    )
    return seeds


def pairs_seeds() -> dict[str, bytes]:
    """Pairs files: the shapes a real one takes, and each class the reader refuses."""
    row = {"image": "a.png", "question": "what shape is the blue object?"}
    full = {**row, "answer": "square", "foil": "circle", "target_mask": "m.png", "id": 3, "kind": "shape"}
    line = _json(row) + b"\n"
    return {
        "one.jsonl": line,
        "full.jsonl": _json(full) + b"\n" + _json({**row, "answer_text": "a square", "answer_token_index": 1}) + b"\n",
        "bom-crlf-blank.jsonl": codecs.BOM_UTF8 + line.replace(b"\n", b"\r\n") + b"\r\n\n" + line,
        "home.jsonl": _json({**row, "image": "~/a.png"}) + b"\n",
        "no-such-user.jsonl": _json({**row, "image": "~no-such-user-of-vlm-readout/a.png"}) + b"\n",
        "mask-no-such-user.jsonl": _json({**row, "target_mask": "~nobody-here-x/m.png"}) + b"\n",
        "nan.jsonl": b'{"image": "a.png", "question": "q?", "x": NaN}\n',
        "nested.jsonl": b'{"image": "a.png", "question": "q?", "x": ' + b"[" * 200 + b"]" * 200 + b"}\n",
        "huge-int.jsonl": b'{"image": "a.png", "question": "q?", "id": ' + b"9" * 5000 + b"}\n",
        "utf16.jsonl": line.decode().encode("utf-16"),
        "latin1.jsonl": '{"image": "café.png", "question": "q?"}\n'.encode("latin-1"),
        "array-line.jsonl": line + b"[1, 2]\n",
        "index-without-text.jsonl": _json({**row, "answer_token_index": 2}) + b"\n",
        "surrogate.jsonl": b'{"image": "a.png", "question": "\\ud800?"}\n',
        "nul.jsonl": b'{"image": "a\\u0000.png", "question": "q?"}\n',
        "blank.jsonl": b"\n  \n",
    }


SEEDS = {"generation": generation_seeds, "lens": lens_seeds, "pairs": pairs_seeds}


def main() -> None:
    for name, seeds in SEEDS.items():
        folder = CORPORA / name
        folder.mkdir(parents=True, exist_ok=True)
        files = seeds()
        for file, data in files.items():
            (folder / file).write_bytes(data)
        total = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{len(files)} seeds written to {folder} ({total:,} bytes in the folder)")


if __name__ == "__main__":
    main()
