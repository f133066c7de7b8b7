"""Hostile images: bombs are refused from their header before anything is
decoded, every decoder failure and every unreadable path is one ImageLoadError
line naming the file, formats outside the allow-list are refused by name."""

import io
import os
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

import core.files.images as images
from core.cli import main as cli_main
from core.errors import ImageLoadError
from core.files.images import MAX_ASPECT_RATIO, MAX_FILE_BYTES, MAX_PIXELS, load_image, to_rgb
from tests.fuzz.hostile_images import (
    dds_bytes,
    eps_bytes,
    jpeg_bytes,
    jpeg_with_repeated_scans,
    png_bytes,
    tiff_bytes,
)
from tests.fuzz.make_corpus import well_formed


def _write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _refused(path_or_bytes, *fragments) -> str:
    """load_image must raise ImageLoadError: one line, naming the file, holding every fragment."""
    with pytest.raises(ImageLoadError) as e:
        load_image(path_or_bytes)
    message = str(e.value)
    assert "\n" not in message
    name = str(path_or_bytes) if isinstance(path_or_bytes, (str, os.PathLike)) else "image bytes"
    assert message.startswith(f"{name}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def decodes(monkeypatch) -> list:
    """Records every frame decode (ImageFile.load) that starts."""
    from PIL import TiffImagePlugin

    calls = []
    for cls in (ImageFile.ImageFile, TiffImagePlugin.TiffImageFile):  # TIFF has its own load (libtiff)
        monkeypatch.setattr(cls, "load", _recording(cls.load, calls))
    return calls


def _recording(load, calls):
    def recorded(self):
        calls.append(self.size)
        return load(self)

    return recorded


# ----- the filed bombs: refused from the header, in milliseconds ------------


def test_tall_tiff_with_one_real_strip_is_refused_before_decoding(tmp_path, decodes):
    # Filed: 16 x 2,686,988 32-bit pixels, one 16-row strip present; was accepted (2.2 GB, 8 s).
    path = _write(
        tmp_path,
        "tall.tif",
        tiff_bytes(16, 2_686_988, samples=1, bits=32, compression=1, rows_per_strip=16, data=b"\x40" * 1024),
    )
    assert path.stat().st_size < 1200
    start = time.perf_counter()
    _refused(path, "16x2686988", "pixel limit")
    assert time.perf_counter() - start < 1.0
    assert decodes == []


def test_one_strip_8000_square_tiff_is_refused_before_decoding(tmp_path, decodes):
    # Filed: a ~250 KB deflated 8000x8000 32-bit TIFF in one strip took 2.6 GB.
    deflate = zlib.compressobj(9)
    row_block = b"\0" * (8000 * 4 * 500)
    data = b"".join(deflate.compress(row_block) for _ in range(16)) + deflate.flush()
    path = _write(tmp_path, "square.tif", tiff_bytes(8000, 8000, samples=1, bits=32, data=data))
    assert path.stat().st_size < 300_000
    _refused(path, "8000x8000", f"{MAX_PIXELS:,}-pixel limit")
    assert decodes == []


def test_one_by_200000_png_is_refused_for_its_aspect_ratio(tmp_path, decodes):
    # Filed: 469 bytes; a shortest-edge resize to 128 made it 128 x 25,600,000 (10 GB).
    path = _write(tmp_path, "wide.png", png_bytes(1, 200_000))
    assert path.stat().st_size < 1000
    _refused(path, "1x200000", f"{MAX_ASPECT_RATIO}:1")
    assert decodes == []


def test_aspect_ratio_limit_is_inclusive():
    assert load_image(png_bytes(MAX_ASPECT_RATIO, 1)).size == (MAX_ASPECT_RATIO, 1)
    assert load_image(png_bytes(1, MAX_ASPECT_RATIO)).size == (1, MAX_ASPECT_RATIO)
    _refused(png_bytes(MAX_ASPECT_RATIO + 1, 1), "aspect ratio")
    _refused(png_bytes(1, MAX_ASPECT_RATIO + 1), "aspect ratio")


def test_in_memory_images_obey_the_same_size_limits():
    with pytest.raises(ImageLoadError, match="aspect ratio"):
        load_image(np.zeros((1, MAX_ASPECT_RATIO + 1, 3), np.uint8))
    with pytest.raises(ImageLoadError, match="aspect ratio"):
        load_image(Image.new("L", (1, MAX_ASPECT_RATIO + 1)))
    with pytest.raises(ImageLoadError, match="no pixels"):
        load_image(np.zeros((0, 5, 3), np.uint8))
    with pytest.raises(ImageLoadError, match=r"\(H, W, 4\)"):
        load_image(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(ImageLoadError, match="cannot load an image from a int"):
        load_image(12)


def test_tile_declared_larger_than_the_image_is_refused_by_the_decode_budget(tmp_path, decodes):
    # libtiff would allocate the whole 16384x16384 tile for 256 pixels (measured: 770 MB, 1.5 s).
    path = _write(tmp_path, "tile.tif", tiff_bytes(16, 16, tile=(16384, 16384)))
    _refused(path, "16x16 TIFF", "MB limit", "buffers: 1,074 MB")
    assert decodes == []
    assert load_image(tiff_bytes(16, 16, tile=(16, 16))).size == (16, 16)
    assert (16, 16) in decodes  # the recorder does see a TIFF decode


def test_progressive_jpeg_with_too_many_scans_is_refused(tmp_path, decodes):
    # Each repeated scan rescans the whole image (1,000 made a 172 KB 4000x4000 file take 9 s).
    path = _write(tmp_path, "scans.jpg", jpeg_with_repeated_scans(32, 32, images.MAX_JPEG_SCANS))
    _refused(path, "JPEG scans")
    assert decodes == []
    assert load_image(jpeg_with_repeated_scans(32, 32, 20)).size == (32, 32)  # only a warning to libjpeg


def test_decode_cost_counts_the_mode_and_the_decoder(monkeypatch):
    monkeypatch.setattr(images, "MAX_DECODE_BYTES", 64 * 64 * 6)
    assert load_image(png_bytes(64, 64, color_type=0)).size == (64, 64)  # 'L': 1 + 4 (RGB) bytes a pixel
    _refused(png_bytes(64, 64, color_type=6), "would take")  # 'RGBA': 4 + 4


def test_file_larger_than_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "huge.png"
    with open(path, "wb") as f:
        f.write(png_bytes(4, 4))
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written
    _refused(path, f"{MAX_FILE_BYTES + 1:,} bytes, over the {MAX_FILE_BYTES:,}-byte limit for this file")


# ----- decoder exceptions ------------------------------------------------------


def test_dds_that_pillow_cannot_decode_is_refused_by_name(tmp_path):
    data = dds_bytes()
    with pytest.raises(NotImplementedError):  # what crashed the app at start-up
        Image.open(io.BytesIO(data))
    _refused(_write(tmp_path, "texture.dds", data), "DDS images are not accepted", "PNG, JPEG")
    _refused(data, "looks like DDS")


def test_eps_is_refused_without_running_ghostscript(tmp_path, monkeypatch):
    from PIL import EpsImagePlugin

    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: ran.append(a))
    _refused(_write(tmp_path, "figure.eps", eps_bytes()), "EPS images are not accepted")
    assert ran == []


@pytest.mark.parametrize("fmt", ["ICO", "PCX", "SGI", "DDS", "QOI", "MSP", "XBM", "IM", "TGA"])
def test_formats_outside_the_allow_list_are_refused(tmp_path, fmt):
    buffer = io.BytesIO()
    Image.new("RGB" if fmt not in ("MSP", "XBM") else "1", (8, 8)).save(buffer, fmt)
    message = _refused(_write(tmp_path, f"x.{fmt.lower()}", buffer.getvalue()))
    assert f"{fmt} images are not accepted" in message  # named by the extension
    as_bytes = _refused(buffer.getvalue())  # no extension: guessed from the magic bytes, said as a guess
    assert "looks like" in as_bytes or "not an image file in an accepted format" in as_bytes


def test_every_accepted_format_and_mode_still_loads():
    for name, data in well_formed().items():
        img = load_image(data)
        assert img.mode == "RGB" and img.size in ((12, 8), (8, 12), (16, 16), (3, 2)), name


@pytest.mark.parametrize(
    "error",
    [
        NotImplementedError("no decoder"),
        struct.error("unpack requires a buffer of 4 bytes"),
        EOFError(),
        IndexError("list index out of range"),
        KeyError("BitsPerSample"),
        TypeError("unsupported operand"),
        ZeroDivisionError("division by zero"),
        MemoryError(),
        RecursionError("maximum recursion depth exceeded"),
        AttributeError("'NoneType' object has no attribute 'read'"),
        OSError("broken data stream"),
    ],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("stage", ["open", "decode", "exif", "convert"])
def test_any_decoder_exception_becomes_one_line(tmp_path, monkeypatch, error, stage):
    from PIL import PngImagePlugin

    def fail(*args, **kwargs):
        raise error

    target = {
        "open": (PngImagePlugin.PngImageFile, "_open"),
        "decode": (ImageFile.ImageFile, "load"),
        "exif": (images.ImageOps, "exif_transpose"),
        "convert": (images, "to_rgb"),
    }[stage]
    monkeypatch.setattr(*target, fail)
    path = _write(tmp_path, "photo.png", png_bytes(6, 4, color_type=6))
    message = _refused(path)
    if stage == "open" and isinstance(error, (IndexError, TypeError, struct.error)):
        assert "header cannot be read" in message  # Pillow treats these as "not this format"
    elif isinstance(error, MemoryError) and stage != "exif":
        assert "out of memory" in message


# ----- paths that are not readable image files ----------------------------------


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads a chmod-000 file")
def test_permission_denied_file(tmp_path):
    path = _write(tmp_path, "secret.png", png_bytes(4, 4))
    path.chmod(0)
    try:
        _refused(path, "permission denied")
    finally:
        path.chmod(0o644)


def test_permission_denied_as_the_os_reports_it(tmp_path, monkeypatch):
    path = _write(tmp_path, "secret.png", png_bytes(4, 4))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(images.os, "open", denied)
    _refused(path, "permission denied")


def test_directory_is_refused(tmp_path):
    _refused(tmp_path, "is a folder")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    outcome = []

    def attempt():
        try:
            load_image(fifo)
        except ImageLoadError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # unblock it: open the FIFO for writing once
        with open(fifo, "wb"):
            pass
        pytest.fail("load_image blocked on a FIFO")
    assert outcome and outcome[0].startswith(f"{fifo}: ") and "not a regular file" in outcome[0]


@pytest.mark.skipif(os.name != "posix", reason="symlink loops and NUL paths are POSIX examples")
def test_other_unopenable_paths(tmp_path):
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    _refused(loop, "cannot open")
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "gone.png")
    _refused(dangling, "no such file")
    _refused(str(tmp_path / "a\0b.png"), "cannot open")
    _refused(tmp_path / ("x" * 300 + ".png"), "cannot open")
    _refused(_write(tmp_path, "file.png", b"x") / "child.png", "no such file")


# ----- numbers are unchanged by the memory-bounded conversion ---------------


def _whole_image_scaled(img: Image.Image) -> np.ndarray:
    """The conversion of 16-bit / float greyscale before it went band by band."""
    arr = np.asarray(img, dtype=np.float64)
    lo, hi = float(arr.min()), float(arr.max())
    if img.mode.startswith("I;16"):
        lo, hi = 0.0, 65535.0
    scaled = np.zeros_like(arr) if hi <= lo else (arr - lo) / (hi - lo) * 255.0
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_banded_rescale_equals_the_whole_image_one(monkeypatch, mode):
    monkeypatch.setattr(images, "_BAND_PIXELS", 50)  # one row per band
    rng = np.random.default_rng(0)
    values = {
        "I;16": rng.integers(0, 65536, (41, 37)).astype(np.uint16),
        "I": rng.integers(-(2**31), 2**31, (41, 37)).astype(np.int32),
        "F": rng.normal(0, 1e3, (41, 37)).astype(np.float32),
    }[mode]
    img = Image.fromarray(values)
    assert img.mode == mode
    out = np.asarray(to_rgb(img))
    assert (out == _whole_image_scaled(img)[..., None]).all()


def test_banded_alpha_composite_equals_the_whole_image_one(monkeypatch):
    monkeypatch.setattr(images, "_BAND_PIXELS", 50)
    rgba = Image.fromarray(np.random.default_rng(1).integers(0, 256, (41, 37, 4), dtype=np.uint8))
    whole = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    assert np.array_equal(np.asarray(to_rgb(rgba)), np.asarray(whole))


def test_float_image_with_nan_is_refused(tmp_path):
    values = np.ones((4, 4), np.float32)
    values[1, 2] = np.nan
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "TIFF")
    _refused(_write(tmp_path, "depth.tif", buffer.getvalue()), "NaN or infinite")


# ----- the CLI: one line, no traceback ------------------------------------------


def test_cli_answer_with_a_hostile_image_is_one_error_line(tmp_path, capsys):
    bad = _write(tmp_path, "texture.dds", dds_bytes())
    code = cli_main(["answer", "--image", str(bad), "--question", "q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith(f"error: {bad}: ") and "DDS" in err[0]


def test_baseline_jpeg_still_loads_from_a_path(tmp_path):
    assert load_image(_write(tmp_path, "photo.jpg", jpeg_bytes(30, 20))).size == (30, 20)


@pytest.mark.parametrize(
    "name, data, named",
    [
        ("mask.dds", dds_bytes(), "mask.dds"),
        ("wide.png", png_bytes(1, 200_000), "aspect"),
        ("mask.eps", eps_bytes(), "EPS images are not accepted"),
    ],
)
def test_mask_files_go_through_the_same_checks(tmp_path, name, data, named):
    """Region masks (counterfactual --mask, dataset masks) are image files too."""
    from core.files.pairs import Pair, load_pair_mask
    from core.methods.counterfactual import mask_from_png

    path = tmp_path / name
    path.write_bytes(data)
    pair = Pair(0, 1, "pairs.jsonl:1", "a.png", tmp_path / "a.png", "q", target_mask=path)
    for read in (lambda: mask_from_png(path, (4, 4)), lambda: load_pair_mask(pair, (4, 4))):
        with pytest.raises(ImageLoadError, match=named) as e:
            read()
        assert "\n" not in str(e.value)


def test_mask_reads_luminance_and_alpha(tmp_path):
    from core.files.images import load_mask

    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[..., :3] = 255
    rgba[0, :, 3] = 255  # top row opaque white: inside; bottom row transparent white: outside
    Image.fromarray(rgba, "RGBA").save(tmp_path / "m.png")
    Image.fromarray(np.array([[0, 200, 127]], np.uint8), "L").save(tmp_path / "l.png")
    assert load_mask(tmp_path / "m.png").tolist() == [[True] * 3, [False] * 3]
    assert load_mask(tmp_path / "l.png").tolist() == [[False, True, False]]


def test_pairs_images_are_checked_before_the_model_loads_and_decoded_per_batch(tmp_path, capsys, monkeypatch):
    """``answer --pairs``: a hostile image on line 2 is named with its line
    before any model loads; good files are only header-checked up front."""
    import core.cli

    good = tmp_path / "good.png"
    Image.new("RGB", (8, 8)).save(good)
    (tmp_path / "wide.png").write_bytes(png_bytes(1, 200_000))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"image": "good.png", "question": "q"}\n{"image": "wide.png", "question": "q"}\n')
    monkeypatch.setattr(core.cli, "_load", lambda args: pytest.fail("the model loaded before the images were checked"))
    assert cli_main(["answer", "--pairs", str(pairs)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {pairs}:2: ") and "aspect ratio" in err and "\n" not in err
    assert images.check_image_file(good) == (8, 8)


def _llava_with_processor_size(tmp_path, size: dict):
    import json
    import shutil

    from core.models.loading import load_model, resources_dir

    folder = tmp_path / "llava"
    shutil.copytree(resources_dir() / "models" / "shapes-llava", folder)
    (folder / "MANIFEST.sha256").unlink()  # a user's folder, edited on purpose
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"]["size"] = size
    (folder / "processor_config.json").write_text(json.dumps(config))
    return load_model(folder)


def test_processor_config_that_would_resize_past_the_budget_is_refused(tmp_path):
    """Filed kind: the resize, not the decode, is the bomb (shortest_edge 60000
    made a 128 x 128 sample 60000 x 60000: 24 GB before the crop)."""
    from core.answer import answer

    loaded = _llava_with_processor_size(tmp_path, {"shortest_edge": 60_000})
    start = time.perf_counter()
    with pytest.raises(
        ImageLoadError, match=r"resize the 128x128 image to about 3,600,000,000 pixels .*shortest_edge = 60000"
    ):
        answer(loaded, Image.new("RGB", (128, 128)), "what shape is the blue object?")
    assert time.perf_counter() - start < 5


def test_elongated_image_is_refused_where_the_shortest_edge_resize_amplifies_it(tmp_path):
    """Within load_image's aspect limit, a 1 x 200 image at shortest_edge 512 is 512 x 102,400 = 52M pixels."""
    loaded = _llava_with_processor_size(tmp_path, {"shortest_edge": 512})
    adapter = loaded.adapter
    assert adapter.resized_pixels((1, 200)) == (512 * 102_400, "size.shortest_edge = 512")
    with pytest.raises(ImageLoadError, match="over the 40,000,000-pixel limit"):
        adapter.check_resize((1, 200))
    adapter.check_resize((128, 128))  # ordinary images are untouched
    assert loaded.adapter.resized_pixels((300, 200)) == (768 * 512, "size.shortest_edge = 512")


def test_processor_size_that_is_not_a_positive_integer_is_named(tmp_path):
    from core.errors import ReadoutError

    # transformers accepts it; the load refuses it (core/models/config_check.py), naming the file and field
    with pytest.raises(ReadoutError, match=r"processor_config.json image_processor.size.shortest_edge: expected an"):
        _llava_with_processor_size(tmp_path, {"shortest_edge": -3})


def test_qwen_resize_estimate_is_smart_resize():
    from tests.core.test_qwen2_vl import tiny_qwen_float64

    loaded = tiny_qwen_float64()
    pixels, setting = loaded.adapter.resized_pixels((64, 48))
    _, _, rh, rw = loaded.adapter.visual_grid((64, 48))
    assert pixels == rh * rw and "max_pixels" in setting
    with pytest.raises(ImageLoadError, match="cannot resize the 2000x4 image"):
        loaded.adapter.check_resize((2000, 4))  # 500:1, which smart_resize refuses


def test_llava_next_estimate_covers_the_high_resolution_canvas():
    """The anyres canvas (the best grid pinpoint) is what gets large: a config
    pinpoint of 300 x 300 tiles is refused by name, the tiny model's own is not."""
    from tests.core.test_llava_next import tiny_llava_next_float64

    adapter = tiny_llava_next_float64().adapter
    adapter.check_resize((300, 200))
    tile = int(adapter.model.config.vision_config.image_size)
    huge = [[300 * tile, 300 * tile]]
    adapter.model.config.image_grid_pinpoints = huge
    adapter.processor.image_processor.image_grid_pinpoints = huge
    pixels, setting = adapter.resized_pixels((300, 200))
    assert pixels == (300 * tile) ** 2 and setting == f"image_grid_pinpoints {huge[0]}"
    with pytest.raises(ImageLoadError, match="image_grid_pinpoints"):
        adapter.check_resize((300, 200))
