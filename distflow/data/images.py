"""Images in prompts: decoding verl's `images` column, the model's image processor, and
the pixel tensors a batch carries.

A prompt's text holds one `<image>` placeholder per image (verl's convention). The
image processor of the model folder (Qwen2-VL's, loaded with `AutoImageProcessor`)
turns the images into `pixel_values` (patches, patch features) and `image_grid_thw`
(images, 3), and each placeholder becomes `<|vision_start|>`, one `<|image_pad|>` per
merged patch, `<|vision_end|>`, as Qwen2-VL's processor writes it. So image tokens are
ordinary prompt tokens: the coordinator balances and micro-batches by them like any other.

In a batch, images are ragged (each sample has its own number of images and patches),
so they travel padded per sample: `pixel_values` (B, max patches, D) and `image_grid_thw`
(B, max images, 3), whose all-zero rows are padding; `model_inputs` takes the real
patches back out, in the flat form the model's forward takes.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import urllib.parse
from typing import Any

import torch

from distflow.data.dataset import DatasetError

PLACEHOLDER = "<image>"
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


class PromptIds(list):
    """A prompt's token ids (a list of ints) and, when it holds images, the processor's
    `pixel_values` (patches, D) and `image_grid_thw` (images, 3) for them."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def decode_image(entry: Any, max_pixels: int | None):
    """One entry of verl's `images` column (`{"bytes": ...}`, `{"path": ...}`,
    `{"image": ...}`, raw bytes, a path, a `file://` URL or a base64 `data:` URI) as an RGB
    PIL image; a DatasetError saying why if it cannot be used (the
    prompt reader adds which row)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path") or entry.get("image")
    if isinstance(entry, str) and entry.startswith("data:"):  # data:image/png;base64,...
        entry = _data_uri_bytes(entry)
    elif isinstance(entry, str) and entry.startswith("file://"):
        url = urllib.parse.urlparse(entry)  # file://imgs/a.png: a relative path, as qwen-vl-utils reads it
        entry = urllib.parse.unquote(url.path if url.netloc in ("", "localhost") else url.netloc + url.path)
    elif isinstance(entry, str) and entry.startswith(("http://", "https://")):
        raise DatasetError(f"image {entry[:80]}: a URL is not fetched (nothing is downloaded); store the image's "
                           "bytes or a local path")
    if isinstance(entry, (bytes, bytearray)):
        source, what = io.BytesIO(entry), f"{len(entry)} bytes"
    elif isinstance(entry, str):
        source, what = os.path.expanduser(entry), entry
        if not os.path.isfile(source):
            raise DatasetError(f"image file {entry} does not exist (a relative path is looked for beside the data "
                               f"file, then in the working directory {os.getcwd()})")
    else:
        raise DatasetError(f"an image must be bytes, a path or {{'bytes'|'path': ...}}, "
                           f"not {type(entry).__name__}")
    try:
        with Image.open(source) as image:  # reads the header; pixels are decoded by convert
            return _rgb(image, max_pixels)
    except Image.DecompressionBombError as e:  # Pillow's own limit on what it decodes
        raise DatasetError(f"image ({what}) is over Pillow's decompression-bomb limit ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:  # PIL's errors for truncated or foreign data
        raise DatasetError(f"image ({what}) cannot be decoded ({type(e).__name__})") from None


def _data_uri_bytes(uri: str) -> bytes:
    header, comma, data = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise DatasetError(f"image {uri[:40]}...: a data URI must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode("".join(data.split()), validate=True)  # line-wrapped (76 columns) too
    except binascii.Error:
        raise DatasetError(f"image {uri[:40]}...: its base64 data cannot be decoded") from None


def _within(size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """`size` scaled down to at most `max_pixels` pixels, its aspect ratio kept."""
    scale = math.sqrt(max_pixels / (size[0] * size[1]))
    width, height = (max(1, math.floor(side * scale + 1e-9)) for side in size)  # 400 x 0.1 is 40, not 39.99...
    while width * height > max_pixels and max(width, height) > 1:  # that margin never takes it over
        width, height = (width - 1, height) if width >= height else (width, height - 1)
    return width, height


def _rgb(image, max_pixels: int | None = None):
    """RGB as the picture is seen: turned upright by its EXIF orientation (a phone's photo;
    as transformers' `load_image`), transparency on white (a diagram's transparent
    background turned black; as qwen-vl-utils and vLLM read images); with more than
    `max_pixels`, scaled down to at most that many, its aspect ratio kept (qwen-vl-utils
    and the Qwen2-VL processor scale a larger image down to their max_pixels too)."""
    from PIL import ExifTags, Image, ImageOps

    target = None
    if max_pixels and image.width * image.height > max_pixels:
        target = _within(image.size, max_pixels)
        image.draft(None, target)  # a JPEG decodes at a smaller scale (at least `target`) straight away
        if image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8):  # turned a quarter upright below
            target = target[::-1]
    image = ImageOps.exif_transpose(image)
    if target is not None and image.size != target:
        image = image.resize(target, Image.Resampling.BICUBIC)
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:  # an alpha channel, or a colour key
        rgba = image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.getchannel("A"))
        return white
    return image.convert("RGB")


class ImagePrompter:
    """Prompt text with `<image>` placeholders and its images -> PromptIds, with the
    model folder's image processor and the vision token names of its config. The pixels
    are kept in `pixel_dtype`, the run's compute dtype: the vision tower casts them to
    it before anything else (its patch embedding's first step, or autocast's), so bf16
    keeps what the model sees in half the bytes."""

    def __init__(self, processor, tokenizer, config, pixel_dtype: torch.dtype = torch.float32):
        self.processor, self.pixel_dtype = processor, pixel_dtype
        self.merge = int(getattr(processor, "merge_size", 1)) ** 2  # patches per image token
        # the values of one patch (RGB x frames x pixels): pixel_values' width
        self.patch_width = 3 * int(getattr(processor, "temporal_patch_size", 1)) * int(processor.patch_size) ** 2
        names = tokenizer.convert_ids_to_tokens([config.vision_start_token_id, config.image_token_id,
                                                 config.vision_end_token_id])
        self.start, self.pad, self.end = names

    def encode(self, tokenizer, text: str, images: list) -> PromptIds:
        for name in (self.start, self.pad, self.end):
            if name in text:  # it would tokenise to the model's own image token, with no image behind it
                raise DatasetError(f"the prompt's text holds the vision token {name}; only {PLACEHOLDER} "
                                   "placeholders stand for images")
        if text.count(PLACEHOLDER) != len(images):
            raise DatasetError(f"the prompt has {text.count(PLACEHOLDER)} {PLACEHOLDER} placeholders "
                               f"but the row has {len(images)} images")
        pieces = text.split(PLACEHOLDER)
        out = PromptIds()
        if images:
            inputs = self.processor(images=images, return_tensors="pt")
            grid = inputs["image_grid_thw"].long()
            tokens = [self.start + self.pad * (int(g.prod()) // self.merge) + self.end for g in grid]
            text = pieces[0] + "".join(t + p for t, p in zip(tokens, pieces[1:]))
            out.pixel_values, out.image_grid_thw = inputs["pixel_values"].to(self.pixel_dtype), grid
        out.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        return out


def vision_token_ids(config) -> list[int]:
    """A VLM's placeholder tokens (image, video, vision start and end), which only a prompt
    may hold: generation must not sample them ([] for a text-only model)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({getattr(config, n) for n in names if getattr(config, n, None) is not None})


def image_fields(prompts: list[list[int]], patch_width: int | None = None,
                 pixel_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The batch fields of the prompts' images, padded per sample. Where none has any:
    {}, or with `patch_width` (a vision-language run's, whose every batch carries the
    fields) one all-zero padding image per sample, in `pixel_dtype`."""
    with_images = [p for p in prompts if getattr(p, "pixel_values", None) is not None]
    if not with_images and patch_width is None:
        return {}
    features = with_images[0].pixel_values.shape[1] if with_images else patch_width
    dtype = with_images[0].pixel_values.dtype if with_images else pixel_dtype
    patches = max((p.pixel_values.shape[0] for p in with_images), default=1)
    images = max((p.image_grid_thw.shape[0] for p in with_images), default=1)
    pixels = torch.zeros((len(prompts), patches, features), dtype=dtype)
    grids = torch.zeros((len(prompts), images, 3), dtype=torch.long)
    for i, p in enumerate(prompts):
        if getattr(p, "pixel_values", None) is not None:
            pixels[i, : p.pixel_values.shape[0]] = p.pixel_values
            grids[i, : p.image_grid_thw.shape[0]] = p.image_grid_thw
    return {"pixel_values": pixels, "image_grid_thw": grids}


def attach_images(prompts: list[list[int]], fields: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each prompt's ids with its row's images from the padded batch fields (inverse of
    `image_fields`); the prompts as they are when the batch has none."""
    if "image_grid_thw" not in fields:
        return prompts
    out = []
    for ids, pixels, grids in zip(prompts, fields["pixel_values"], fields["image_grid_thw"]):
        p = PromptIds(ids)
        real = grids[grids.prod(-1) > 0]
        if len(real):
            p.pixel_values, p.image_grid_thw = pixels[: int(real.prod(-1).sum())], real
        out.append(p)
    return out


def holds_images(fields: dict[str, torch.Tensor]) -> bool:
    """Whether the padded per-sample fields hold a real image (padding grids are all zero)."""
    return "image_grid_thw" in fields and bool(fields["image_grid_thw"].prod(-1).sum() > 0)


def model_inputs(fields: dict[str, torch.Tensor], input_ids: torch.Tensor,
                 image_token_id: int) -> dict[str, torch.Tensor]:
    """The padded per-sample fields as the model's forward takes them beside `input_ids`
    (B, L): every real patch in sample order (patches, D), every real image's grid
    (images, 3), and which tokens are image tokens (`mm_token_type_ids`, for M-RoPE);
    {} without images."""
    if not holds_images(fields):
        return {}
    grids, pixels = fields["image_grid_thw"], fields["pixel_values"]
    real = grids.prod(-1) > 0  # (B, I): padding rows are all zero
    counts = grids.prod(-1).sum(-1).tolist()  # patches per sample
    flat = torch.cat([pixels[i, :n] for i, n in enumerate(counts) if n])
    return {"pixel_values": flat, "image_grid_thw": grids[real],
            "mm_token_type_ids": (input_ids == image_token_id).int()}
