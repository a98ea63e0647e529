"""Encoding one image for a shard: checking it decodes, JPEG pass-through or re-encode, Example bytes.

Baseline RGB JPEGs are stored byte for byte (no generation loss, no time spent); everything else
(PNG, CMYK, grayscale, progressive, ...) is re-encoded as baseline RGB JPEG so that
`tf.io.decode_jpeg` reads every record. The Example carries exactly FEATURE_KEYS, as
build_imagenet_data.py writes them.
"""

from __future__ import annotations

import io
import os
import struct

import numpy as np
from PIL import Image

from tfscale.data.convert.sources import Item

FEATURE_KEYS = (
    "image/encoded",
    "image/format",
    "image/height",
    "image/width",
    "image/channels",
    "image/colorspace",
    "image/class/label",
    "image/class/synset",
    "image/class/text",
    "image/filename",
)
JPEG_QUALITY = 95
# Huffman-coded sequential JPEG (SOF0 baseline, SOF1 extended): what every libjpeg build decodes.
_PASS_THROUGH_SOF_MARKERS = (0xC0, 0xC1)


def check_image(path: str) -> str | None:
    """Why PIL cannot fully decode the file at `path`, or None when it can."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file (0 bytes)"
        with Image.open(path) as img:
            img.load()  # open() reads only the header; truncation and bad data show up here
    except Exception as e:  # PIL reports bad data as OSError, SyntaxError, ValueError, struct.error, ...
        return f"cannot decode: {type(e).__name__}: {e}"
    return None


def scan_file(path: str) -> tuple[str | None, int, int]:
    """(reason it is unreadable or None, size in bytes, mtime in ns) of one image; runs in workers."""
    reason = check_image(path)
    stat = os.stat(path)
    return reason, stat.st_size, stat.st_mtime_ns


def jpeg_sof_marker(data: bytes) -> int | None:
    """The start-of-frame marker (0xC0 baseline, 0xC2 progressive, ...) of JPEG `data`, or None."""
    pos = 2  # after SOI
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length field
            pos += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn, not DHT/JPG/DAC
            return marker
        else:
            pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    return None


def can_pass_through(img: Image.Image, data: bytes) -> bool:
    """True when `data` is an 8-bit, sequential, RGB JPEG: bytes every TF JPEG decoder reads as is.

    Decided by the decoded format and mode, never the extension (ImageNet has a PNG named .JPEG and
    22 CMYK JPEGs). Progressive/arithmetic/12-bit JPEGs are re-encoded: PIL may read some of them
    where a reader's libjpeg build does not.
    """
    return img.format == "JPEG" and img.mode == "RGB" and jpeg_sof_marker(data) in _PASS_THROUGH_SOF_MARKERS


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB pixels of any PIL image; transparency is composited over white, as viewers show it."""
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I"):  # 16-bit grayscale PNG: convert("RGB") would clip it to white
        gray = np.asarray(img, dtype=np.float64) / 257.0
        return Image.fromarray(np.clip(np.rint(gray), 0, 255).astype(np.uint8)).convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")  # L, P, CMYK, YCbCr, 1, ...


def resized_size(width_px: int, height_px: int, shorter_px: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shorter_px` and the aspect ratio kept."""
    scale = shorter_px / min(width_px, height_px)
    return max(1, round(width_px * scale)), max(1, round(height_px * scale))


def encode_image(path: str, resize_shorter: int = 0) -> tuple[bytes, int, int]:
    """(JPEG bytes, height, width) to store for the image at `path`.

    Baseline RGB JPEGs that need no resizing come back byte for byte: no generation loss, no time
    spent. Everything else is decoded, made RGB, shrunk if its shorter side exceeds `resize_shorter`
    (0: never) and encoded as baseline JPEG at quality JPEG_QUALITY.
    """
    with open(path, "rb") as f:
        data = f.read()
    with Image.open(io.BytesIO(data)) as img:
        width_px, height_px = img.size
        shrink = 0 < resize_shorter < min(width_px, height_px)
        if not shrink and can_pass_through(img, data):
            return data, height_px, width_px
        rgb = to_rgb(img)
        if shrink:
            # reducing_gap: a fast box reduction first, LANCZOS for the last factor 3 (visually identical).
            rgb = rgb.resize(resized_size(width_px, height_px, resize_shorter), Image.Resampling.LANCZOS,
                             reducing_gap=3.0)
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=JPEG_QUALITY)  # baseline, 4:2:0, as ImageNet's own JPEGs
    return out.getvalue(), rgb.height, rgb.width


def example_bytes(jpeg: bytes, height_px: int, width_px: int, item: Item, *, image_format: bytes = b"JPEG",
                  channels: int = 3, colorspace: bytes = b"RGB") -> bytes:
    """A serialized tf.train.Example with exactly the FEATURE_KEYS, as build_imagenet_data.py writes.

    `jpeg` is the encoded image: a JPEG unless `image_format` says otherwise (tfscale.data.convert.arrays: PNG).
    """
    import tensorflow as tf  # imported where needed: listing and checking inputs stay fast

    def _bytes(value: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def _int64(value: int):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    feature = {
        "image/encoded": _bytes(jpeg),
        "image/format": _bytes(image_format),
        "image/height": _int64(height_px),
        "image/width": _int64(width_px),
        "image/channels": _int64(channels),
        "image/colorspace": _bytes(colorspace),
        "image/class/label": _int64(item.label),
        "image/class/synset": _bytes(item.synset.encode("utf-8")),
        "image/class/text": _bytes(item.text.encode("utf-8")),
        "image/filename": _bytes(os.path.basename(item.path).encode("utf-8")),
    }
    # deterministic=True sorts the feature map: identical bytes from every process and every run.
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(deterministic=True)
