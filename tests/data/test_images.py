import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from distflow.data.batch import Batch
from distflow.data.dataset import DatasetError, PromptReader, ShardedDataset, load_rows, write_builtin_parquet
from distflow.data.images import PromptIds, attach_images, decode_image, image_fields, model_inputs
from distflow.data.tasks import dots


def _dark_blobs(png: bytes) -> int:
    """Connected groups of dark pixels: the dots a person would count."""
    image = Image.open(io.BytesIO(png)).convert("L")
    dark = {(x, y) for x in range(image.width) for y in range(image.height) if image.getpixel((x, y)) < 60}  # black dots on mid-grey
    blobs = 0
    while dark:
        blobs += 1
        todo = [dark.pop()]
        while todo:
            x, y = todo.pop()
            for n in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if n in dark:
                    dark.remove(n)
                    todo.append(n)
    return blobs


def test_dots_rows_are_verl_multimodal_rows_whose_answer_is_the_dots_drawn():
    rows = load_rows("builtin:dots:test:30")
    assert [r.extra_info["level"] for r in rows[:3]] == [1, 2, 3]
    for r in rows:
        assert r.messages == [{"role": "user", "content": dots.QUESTION}] and len(r.images) == 1
        count = int(r.ground_truth)
        assert 3 * r.extra_info["level"] - 2 <= count <= 3 * r.extra_info["level"]
        assert _dark_blobs(r.images[0]["bytes"]) == count
    train = {p.centers for p in dots.generate("train", 3000)}
    assert not train & {p.centers for p in dots.generate("test", 300)}  # disjoint splits


def test_dots_parquet_round_trip_equals_builtin(tmp_path):
    path = write_builtin_parquet(str(tmp_path / "dots.parquet"), "dots", "train", 12)
    assert load_rows(path) == load_rows("builtin:dots:train:12")


def _png(width, height):
    out = io.BytesIO()
    Image.new("RGB", (width, height), "white").save(out, format="PNG")
    return out.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims another size (its pixels are never decoded)."""
    import struct
    import zlib

    data = bytearray(_png(2, 2))
    header = struct.pack(">II", width, height) + bytes(data[24:29])  # IHDR's data starts at byte 16
    data[16:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(data)


@pytest.mark.parametrize("entry, fragment", [
    (b"\x89PNG not really", "image (15 bytes) cannot be decoded"),
    # over Pillow's decompression-bomb limit (it said "cannot be encoded")
    ({"bytes": _png_claiming(20000, 20000)}, "is over Pillow's decompression-bomb limit"),
    ({"path": "/nonexistent/cat.png"}, "image file /nonexistent/cat.png does not exist"),
    (7, "an image must be bytes, a path"),
    ("data:image/png,abc", "image data:image/png,abc...: a data URI must be base64"),
    ("data:image/png;base64,@@", "its base64 data cannot be decoded"),
    ({"image": "https://example.com/a.png"}, "a URL is not fetched (nothing is downloaded)"),
])
def test_bad_images_are_one_line_errors(entry, fragment):
    with pytest.raises(DatasetError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        decode_image(entry, max_pixels=1000)


def test_an_image_of_more_than_max_pixels_is_scaled_down_to_them_as_qwen_vl_utils_does():
    """It was a bad row: a 12 MP photo stopped the run that verl and TRL train on (the
    processor's max_pixels is what it scales down to, not what it refuses)."""
    import io

    assert decode_image({"bytes": _png(40, 30)}, max_pixels=1000).size == (36, 27)  # 972 pixels, 4:3 kept
    out = io.BytesIO()
    Image.new("RGB", (400, 300), "red").save(out, format="JPEG")
    scaled = decode_image(out.getvalue(), max_pixels=1200)
    assert scaled.size == (40, 30) and scaled.mode == "RGB" and scaled.getpixel((20, 15))[0] > 200
    turned = Image.new("RGB", (400, 300), "red")  # a phone's photo, upright a quarter turn away
    exif = turned.getexif()
    exif[0x0112] = 6
    out = io.BytesIO()
    turned.save(out, format="JPEG", exif=exif.tobytes())
    assert decode_image(out.getvalue(), max_pixels=1200).size == (30, 40)


def test_images_decode_from_bytes_paths_and_verl_dicts(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png(8, 6))
    for entry in (_png(8, 6), str(path), {"path": str(path)}, {"bytes": _png(8, 6), "path": None}):
        image = decode_image(entry, max_pixels=48)
        assert image.size == (8, 6) and image.mode == "RGB"


def test_images_decode_from_qwen_vl_utils_entries_data_uris_and_file_urls(tmp_path, monkeypatch):
    """qwen-vl-utils' and verl's `{"image": ...}` holds a data: URI or a file:// URL; each
    was read as a path that does not exist (a relative file://imgs/a.png as /a.png)."""
    path = tmp_path / "a b.png"
    path.write_bytes(_png(8, 6))
    uri = "data:image/png;base64," + base64.b64encode(_png(8, 6)).decode()
    wrapped = "data:image/png;base64," + base64.encodebytes(_png(8, 6)).decode()  # MIME's 76-column lines
    for entry in (uri, wrapped, {"image": uri}, f"file://{tmp_path}/a%20b.png", {"image": f"file://{path}"},
                  f"file://localhost{tmp_path}/a%20b.png"):
        assert decode_image(entry, max_pixels=None).size == (8, 6)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "c.png").write_bytes(_png(4, 2))
    monkeypatch.chdir(tmp_path)
    assert decode_image({"image": "file://imgs/c.png"}, max_pixels=None).size == (4, 2)


def test_transparency_is_on_white_and_exif_orientation_is_applied():
    """A transparent PNG's background came out black (alpha dropped, not composited); a
    phone photo came out as stored, not as taken (EXIF orientation ignored)."""
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    clear.putpixel((0, 0), (0, 0, 0, 255))
    out = io.BytesIO()
    clear.save(out, format="PNG")
    image = decode_image(out.getvalue(), None)
    assert image.getpixel((0, 0)) == (0, 0, 0) and image.getpixel((3, 3)) == (255, 255, 255)
    keyed = io.BytesIO()  # an RGB picture whose black is its transparent colour key
    Image.new("RGB", (2, 2), (0, 0, 0)).save(keyed, format="PNG", transparency=(0, 0, 0))
    assert decode_image(keyed.getvalue(), None).getpixel((0, 0)) == (255, 255, 255)
    photo, exif = io.BytesIO(), Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees to view
    Image.new("RGB", (4, 2), "red").save(photo, format="JPEG", exif=exif)
    assert decode_image(photo.getvalue(), None).size == (2, 4)


def test_a_relative_image_path_names_a_file_beside_the_data_file_else_in_the_working_directory(tmp_path,
                                                                                                  monkeypatch):
    data, elsewhere = tmp_path / "data", tmp_path / "run"
    (data / "img").mkdir(parents=True)
    elsewhere.mkdir()
    (data / "img" / "a.png").write_bytes(_png(8, 6))
    (elsewhere / "cwd.png").write_bytes(_png(4, 4))
    row = {"prompt": "<image> count", "reward_model": {"ground_truth": "1"}}
    rows = [row | {"images": ["img/a.png"]}, row | {"images": [{"path": "img/a.png", "bytes": None}]},
            row | {"images": ["cwd.png"]}, row | {"images": ["missing.png"]}, row | {"images": [{"image": "img/a.png"}]}]
    (data / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.chdir(elsewhere)  # the run starts in another folder than the data's
    got = load_rows(str(data / "rows.jsonl"))
    assert got[0].images == [str(data / "img" / "a.png")]
    assert got[1].images == [{"path": str(data / "img" / "a.png"), "bytes": None}]
    assert got[4].images == [{"image": str(data / "img" / "a.png")}]
    assert [decode_image(r.images[0], None).size for r in got[:3]] == [(8, 6), (8, 6), (4, 4)]
    with pytest.raises(DatasetError, match=r"image file missing.png does not exist \(a relative path is looked "
                                           r"for beside the data file, then in the working directory"):
        decode_image(got[3].images[0], None)


def _rows_with_a_bad_image(tmp_path):
    rows = [dots.to_verl_row(p, i, "train") for i, p in enumerate(dots.generate("train", 30))]
    rows[2]["images"] = [{"bytes": b"garbage", "path": None}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _decode_all(row):
    images = [decode_image(e, max_pixels=None) for e in row.images]
    return PromptIds(range(len(images) + 1))


def test_a_bad_image_is_a_bad_row_under_the_bad_row_policy(tmp_path):
    path = _rows_with_a_bad_image(tmp_path)
    data = ShardedDataset(path)
    with pytest.raises(DatasetError, match=r"d.parquet: row 2: image \(7 bytes\) cannot be decoded "
                                           r"\(UnidentifiedImageError\) \(data.on_bad_row=skip to go on\)"):
        PromptReader(data, 64).take([0, 1, 2], _decode_all)
    taken, counts = PromptReader(data, 64, on_bad_row="skip").take([0, 1, 2], _decode_all)
    assert len(taken) == 3 and counts["skipped_rows"] == 1 and taken[2][0].index != 2  # replaced


def _prompt(n_ids, grids):
    p = PromptIds(range(n_ids))
    if grids:
        p.image_grid_thw = torch.tensor(grids)
        patches = int(p.image_grid_thw.prod(-1).sum())
        p.pixel_values = torch.arange(patches * 3, dtype=torch.float32).view(patches, 3) + 100 * n_ids
    return p


def test_ragged_images_travel_padded_per_sample_and_come_back_exactly():
    prompts = [_prompt(5, [[1, 2, 2]]), _prompt(3, []), _prompt(7, [[1, 2, 4], [1, 2, 2]])]
    fields = image_fields(prompts)
    assert fields["pixel_values"].shape == (3, 12, 3) and fields["image_grid_thw"].shape == (3, 2, 3)
    # through a batch's select and concat (as the coordinator moves rows), then back
    batch = Batch(dict(fields))
    moved = Batch.concat([batch.select([2]), batch.select([0, 1])])
    back = attach_images([list(p) for p in (prompts[2], prompts[0], prompts[1])], moved.tensors)
    for got, want in zip(back, (prompts[2], prompts[0], prompts[1])):
        assert list(got) == list(want)
        if want.pixel_values is None:
            assert got.pixel_values is None
        else:
            assert torch.equal(got.pixel_values, want.pixel_values)
            assert torch.equal(got.image_grid_thw, want.image_grid_thw)
    # the model's flat form: real patches in sample order, real grids, image-token flags
    ids = torch.tensor([[9, 1, 9], [1, 1, 1], [9, 9, 1]])
    flat = model_inputs(fields, ids, image_token_id=9)
    assert torch.equal(flat["pixel_values"], torch.cat([prompts[0].pixel_values, prompts[2].pixel_values]))
    assert flat["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    assert flat["mm_token_type_ids"].tolist() == [[1, 0, 1], [0, 0, 0], [1, 1, 0]]
    assert model_inputs({}, ids, 9) == {}


def test_concat_pads_narrower_3d_fields():
    a = Batch({"pixel_values": torch.ones(1, 2, 3)})
    b = Batch({"pixel_values": torch.full((2, 4, 3), 2.0)})
    out = Batch.concat([a, b])["pixel_values"]
    assert out.shape == (3, 4, 3) and out[0, 2:].abs().sum() == 0 and out[0, :2].eq(1).all()
