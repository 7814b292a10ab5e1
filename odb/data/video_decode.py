"""Videos read into sampled frames: a video file through PyAV, or a folder or list of frame
images through Pillow, each frame resized as it is read (:func:`read_video`).

The sampling (which frames, at what size) is the processor's (:class:`odb.data.videos.VideoSpec`);
this module only decodes. Decoding runs in the DataLoader workers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from odb.data.videos import Clip, VideoSpec

__all__ = ["read_video"]

_FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def read_video(source: str | Path | list[str | Path], spec: VideoSpec, fps: float | None = None) -> Clip:
    """The sampled frames of a video file, a folder of frame images or a list of them (``fps``: the
    frames' rate, for frame images only).

    Raises:
        FileNotFoundError: the file, the folder or a frame is missing.
        ValueError: the video cannot be decoded or sampled (too short, no frames, frames of different sizes).
    """
    if isinstance(source, (list, tuple)) or Path(source).is_dir():
        return _read_frames(source, spec, fps)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(str(path))
    try:
        import av
    except ImportError:
        raise ValueError("reading video files needs PyAV: pip install 'odb[video]' (or pip install av)") from None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate:
                raise ValueError("the video stream has no frame rate")
            native = float(rate)
            # the container's count, else its packets counted (no decoding)
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            for _ in range(2):  # a count the stream over-reports: sampled again over the frames decoded
                wanted = spec.frame_indices(total, native)
                container.seek(0)
                frames, decoded = _decode(container.decode(stream), wanted, spec)
                if len(frames) == len(wanted):
                    return Clip(np.stack(frames), wanted, native, total, resized=True)
                total = decoded
    except (av.error.FFmpegError, UnicodeDecodeError) as err:
        raise ValueError(f"{type(err).__name__}: {err}") from None
    raise ValueError(f"{len(frames)} of the {len(wanted)} sampled frames decoded")


def _decode(decoded, wanted: list[int], spec: VideoSpec | None = None) -> tuple[list[np.ndarray], int]:
    """The frames at the indices ``wanted`` (sorted, repeats allowed) of a decoder's frames, as RGB
    (resized for ``spec`` as they come, where given), and how many frames were decoded (all of them
    where some of ``wanted`` were missing)."""
    out: list[np.ndarray] = []
    at = count = 0
    size = None  # the clip's size, from its first frame (every frame of a stream has the same)
    for index, frame in enumerate(decoded):
        count = index + 1
        if wanted[at] != index:
            continue
        image = frame.to_ndarray(format="rgb24")
        if spec is not None:
            size = size or spec.resized(len(wanted), *image.shape[:2])
            image = _resize(image, size)
        while at < len(wanted) and wanted[at] == index:
            out.append(image)
            at += 1
        if at == len(wanted):
            break
    return out, count


def _read_frames(source: str | Path | list[str | Path], spec: VideoSpec, fps: float | None) -> Clip:
    from PIL import Image

    if isinstance(source, (list, tuple)):
        paths = [Path(p) for p in source]
    else:
        paths = sorted((p for p in Path(source).iterdir() if p.suffix.lower() in _FRAME_SUFFIXES), key=_natural)
    if not paths:
        raise ValueError(f"no frame images ({', '.join(_FRAME_SUFFIXES)}) in {source}")
    rate = float(fps) if fps is not None else spec.sampling_fps()
    keep = min(len(paths), spec.max_frames)  # as transformers takes frames already sampled: all of them
    wanted = np.linspace(0, len(paths) - 1, keep).round().astype(int).tolist() if keep < len(paths) \
        else list(range(len(paths)))
    frames: list[np.ndarray] = []
    first = None
    for index in wanted:
        if not paths[index].is_file():
            raise FileNotFoundError(str(paths[index]))
        try:
            with Image.open(paths[index]) as image:
                frame = np.array(image.convert("RGB"))  # (a writable copy)
        except (OSError, Image.DecompressionBombError) as err:
            raise ValueError(f"{paths[index]}: {err}") from None
        if first is None:
            first, size = frame.shape, spec.resized(len(wanted), *frame.shape[:2])
        elif frame.shape != first:
            raise ValueError(f"frames of different sizes: {first[:2]} and {frame.shape[:2]} ({paths[index]})")
        frames.append(_resize(frame, size))
    return Clip(np.stack(frames), wanted, rate, len(paths), resized=True)


def _resize(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One ``[H, W, 3]`` uint8 frame at ``size``: torchvision's resize of 8-bit frames on the CPU
    (torch's own bicubic with antialiasing), which gives each frame of a batch what it gives alone."""
    if frame.shape[:2] == tuple(size):
        return frame
    image = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1)[None]
    image = torch.nn.functional.interpolate(image, size=size, mode="bicubic", align_corners=False, antialias=True)
    return image[0].permute(1, 2, 0).numpy()


def _natural(path: Path) -> list:
    """A sort key that orders ``2.jpg`` before ``10.jpg`` (digit runs compared as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]
