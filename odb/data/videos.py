"""Videos the model's own way: frames sampled, resized and cut into patches as its video processor does.

A video is a file (decoded with PyAV) or a list of frame images (a folder of them, or paths).
:class:`VideoSpec` holds the model's video processor settings as plain values (so it pickles into
DataLoader workers): a model folder's own ``video_preprocessor_config.json`` (else its
``preprocessor_config.json``, as transformers' ``AutoVideoProcessor`` falls back to), over the
family's defaults, the vision tower's geometry checked. :func:`process_video` then follows the
family's processor step by step:

* **Frames** (:meth:`VideoSpec.frame_indices`): Qwen2-VL / Qwen2.5-VL (transformers'
  ``Qwen2VLVideoProcessor``) take ``fps`` frames a second, clamped to ``[min_frames,
  max_frames]`` and the video's own, rounded down to a multiple of ``temporal_patch_size``, at
  ``arange(0, N, N / n)``; Qwen3-VL (``Qwen3VLVideoProcessor``) ``int(duration * fps)`` clamped
  the same way, at ``linspace(0, N - 1, n)`` rounded. ``num_frames`` instead of ``fps`` takes
  that many. odb always samples (a 10-minute clip decoded whole would be tens of thousands of
  frames): at the data config's ``video_fps``, else the processor's own ``fps``, else 2 (the
  Qwen-VL reference, qwen-vl-utils). A list of frame images is taken as already sampled, at
  the part's ``fps`` (else the rate above), every frame (the last repeated to fill a group),
  thinned only to ``max_frames``.
* **Size**: one ``smart_resize`` for the whole clip (``size`` bounds: per frame for Qwen2-VL, per
  clip for Qwen3-VL, as each processor means them; ``cap_pixels_per_frame`` as the folder sets it),
  bicubic with antialiasing on the 8-bit frames (torch's own ``interpolate``, which is what
  torchvision's resize calls on the CPU), then rescaled and normalized with the processor's mean and std.
* **Patches**: frames grouped ``temporal_patch_size`` at a time (the last repeated to fill the
  group), each group cut into ``patch_size`` patches in ``merge_size`` blocks:
  ``pixel_values_videos [patches, C*T*P*P]`` and ``video_grid_thw`` ``(t, h, w)``.
* **Time**: Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size / sampled fps``;
  Qwen3-VL writes each group's time as ``<t.t seconds>`` before its frame tokens (the mean time
  of the group's frames, :func:`expand_video`).

Why not transformers' own video processors: they need torchvision, whose wheels are built for
one torch release each (a CPU torch beside PyPI's torchvision does not import), and decode with
whatever backend is installed. odb reproduces them in torch; ``tools/check/check_video_processor.py``
compares the result with the folder's own processor where torchvision is installed (figures in
docs/training.md#videos). Why PyAV: maintained, its wheels carry FFmpeg, and it is tied to no torch release
(torchcodec is, and needs a system FFmpeg; decord is unmaintained; torchvision's decoding is gone).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Clip", "VIDEO_FAMILIES", "VIDEO_PAD", "Video", "VideoSpec", "expand_video", "process_video",
           "video_spec_for"]

VIDEO_PAD = "<|video_pad|>"


_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


VIDEO_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": dict(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, image_mean=_CLIP[0], image_std=_CLIP[1],
                  patch_size=14, temporal_patch_size=2, merge_size=2, min_frames=4, max_frames=768, fps=None,
                  num_frames=None, max_video_tokens=128000),
    "qwen3": dict(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, image_mean=(0.5, 0.5, 0.5),
                  image_std=(0.5, 0.5, 0.5), patch_size=16, temporal_patch_size=2, merge_size=2, min_frames=4,
                  max_frames=768, fps=2, num_frames=None, max_video_tokens=768),
}
"""Each family's video processor defaults (transformers 5.24's ``Qwen2VLVideoProcessor`` and
``Qwen3VLVideoProcessor`` class attributes; tests/unit/test_videos.py reads them from its source)."""


_CLASSES = {"qwen2": "Qwen2VLVideoProcessor", "qwen3": "Qwen3VLVideoProcessor"}


_FAMILY = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3"}


_DEFAULT_FPS = 2.0


@dataclass(frozen=True)
class VideoSpec:
    """A model's video processor settings (see the module docstring); built by :func:`video_spec_for`."""

    family: str = "qwen2"
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, ...] = _CLIP[0]
    image_std: tuple[float, ...] = _CLIP[1]
    rescale_factor: float = 1 / 255
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_frames: int = 4
    max_frames: int = 768
    fps: float | None = None
    num_frames: int | None = None
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    seconds: bool = False
    """Qwen2.5-VL: the model takes ``second_per_grid_ts``."""
    layout: str = ""
    """How the model's processor lays out a video's tokens: 'qwen2' (one run) or 'qwen3' (a run
    per temporal group after its time), by model type; '' : as ``family``. (A Qwen3-VL folder
    without a video processor config gets, as in transformers, Qwen2-VL's video processor, and
    keeps Qwen3-VL's layout.)"""

    def frame_indices(self, total: int, native_fps: float) -> list[int]:
        """Which of a video's ``total`` frames (at ``native_fps``) the family's processor keeps."""
        t = self.temporal_patch_size
        if self.family == "qwen2":
            if self.num_frames is not None:
                n = round(self.num_frames / t) * t
            else:
                cap = math.floor(min(self.max_frames, total) / t) * t
                n = min(max(total / native_fps * self.sampling_fps(), self.min_frames), cap, total)
                n = math.floor(n / t) * t
            if not 0 < n <= total:
                raise ValueError(f"a video of {total} frames cannot give {n} frames in groups of {t}")
            return torch.arange(0, total, total / n).int().tolist()
        if self.num_frames is not None:  # as transformers: that many, repeated where the video has fewer
            n = self.num_frames
        else:
            n = min(max(int(total / native_fps * self.sampling_fps()), self.min_frames), self.max_frames, total)
        if n < t:
            raise ValueError(f"a video of {total} frames is shorter than one group of {t} frames")
        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def sampling_fps(self) -> float:
        """The rate odb samples frames at (the module docstring: ``fps``, else 2)."""
        return float(self.fps) if self.fps is not None else _DEFAULT_FPS

    def _rate(self) -> dict[str, Any]:
        """How the exported processor samples: a frame count or a rate (Qwen3-VL's processor cannot
        store a count: its class rate takes over a null fps, and a rate with a count is refused)."""
        if self.num_frames is not None and self.family == "qwen2":
            return {"fps": None, "num_frames": self.num_frames}
        return {"fps": self.sampling_fps(), "num_frames": None}

    def processor_config(self) -> dict[str, Any]:
        """These settings as transformers' ``video_preprocessor_config.json`` of the family's video
        processor, sampling on (at the rate odb sampled at), so that it processes videos as odb did."""
        return {"video_processor_type": _CLASSES[self.family], "do_resize": True, "do_rescale": True,
                "do_normalize": True, "do_convert_rgb": True, "resample": 3,  # bicubic
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "rescale_factor": self.rescale_factor, "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "do_sample_frames": True, **self._rate(), "min_frames": self.min_frames, "max_frames": self.max_frames,
                "cap_pixels_per_frame": self.cap_pixels_per_frame, "max_video_tokens": self.max_video_tokens}

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The height and width every frame of a clip of ``frames`` frames is resized to."""
        factor = self.patch_size * self.merge_size
        count, temporal, low, high = self._bounds(frames)
        if self.family != "qwen2" and (height < factor or width < factor):
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return _smart_resize(count, temporal, height, width, factor, low, high)

    def largest_frame(self, frames: int, *, tokens: int | None = None) -> tuple[int, int] | None:
        """The largest frame ``(height, width)`` the processor makes in a clip of ``frames``
        frames, of at most ``tokens`` visual tokens where given; None where even the smallest it
        makes is over ``tokens``. Either the most ``patch_size x merge_size`` squares its pixel
        bound holds, as square as it goes (a frame of whole squares within the bounds is one
        :meth:`resized` keeps), or a thin one: the resize shrinks both sides alike but keeps at
        least one square, so a frame one square high and up to 200 wide comes out about
        ``sqrt(200 x bound)`` squares wide, over a bound under 200 squares (transformers'
        ``smart_resize`` does the same)."""
        factor = self.patch_size * self.merge_size
        count, temporal, low, high = self._bounds(frames)
        clip = round(count / temporal) * temporal  # (as _smart_resize counts the clip's frames)
        most = high // (clip * factor * factor)
        most = min(most, tokens) if tokens is not None else most
        sides = [(most // cols, cols) for cols in range(1, math.isqrt(max(0, most)) + 1) if most // cols <= 200 * cols]
        rows, cols = max(sides, key=lambda side: (side[0] * side[1], side[1]), default=(0, 0))  # the squarest
        if clip * rows * cols * factor * factor < low:
            rows = cols = 0
        thin = [self.resized(frames, factor, wide * factor) for wide in range(1, 201)]
        thin = [(h, w) for h, w in thin if tokens is None or h * w <= tokens * factor * factor]
        if thin and max(h * w for h, w in thin) > rows * cols * factor * factor:
            return max(thin, key=lambda frame: frame[0] * frame[1])
        return (rows * factor, cols * factor) if rows else None

    def _bounds(self, frames: int) -> tuple[int, int, int, int]:
        """``(frames, temporal, low, high)`` as :func:`_smart_resize` takes them for a clip of
        ``frames`` frames: Qwen2-VL bounds each frame alone, Qwen3-VL the clip (``size`` as each
        processor means it), either with ``cap_pixels_per_frame`` as the folder sets it."""
        factor = self.patch_size * self.merge_size
        low, high = self.min_pixels, self.max_pixels
        if self.family == "qwen2":
            if self.cap_pixels_per_frame:
                total = int(self.max_video_tokens * factor * factor * 0.9)
                high = max(min(high, total * self.temporal_patch_size // frames), int(low * 1.05))
            return 1, 1, low, high
        if frames < self.temporal_patch_size:
            raise ValueError(f"a clip of {frames} frames is shorter than one group of {self.temporal_patch_size}")
        if self.cap_pixels_per_frame:
            high = max(min(self.max_video_tokens * factor * factor, high // frames), int(low * 1.05)) * frames
        return frames, self.temporal_patch_size, low, high


def _smart_resize(frames: int, temporal: int, height: int, width: int, factor: int, low: int,
                  high: int) -> tuple[int, int]:
    """The Qwen-VL processors' resize: sides multiples of ``factor``, the aspect kept, the pixels
    (of the clip: ``frames`` rounded to ``temporal``; 1 and 1 for one frame) within ``[low, high]``."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > high:
        beta = math.sqrt(frames * height * width / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < low:
        beta = math.sqrt(low / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass
class Clip:
    """A video's sampled frames ``[n, H, W, 3]`` uint8, their indices among its ``total`` frames,
    and its frames per second. ``resized``: :func:`read_video` resized each frame as it was read
    (a clip's frames at full size would hold, for 768 sampled 4K frames, 19 GB in a worker)."""

    frames: np.ndarray
    indices: list[int]
    fps: float
    total: int
    resized: bool = False


@dataclass
class Video:
    """A processed video: its patches, grid ``(t, h, w)``, and the seconds of each temporal group."""

    pixel_values: torch.Tensor
    grid: torch.Tensor
    group_seconds: list[float]
    second_per_grid: float


def process_video(clip: Clip, spec: VideoSpec) -> Video:
    """A clip's sampled frames -> the model's video inputs (the module docstring's steps)."""
    n, height, width, _ = clip.frames.shape
    new_h, new_w = (height, width) if clip.resized else spec.resized(n, height, width)
    video = torch.from_numpy(np.ascontiguousarray(clip.frames)).permute(0, 3, 1, 2)
    if (new_h, new_w) != (height, width):  # torchvision's resize of 8-bit frames on the CPU: torch's own
        video = torch.nn.functional.interpolate(video, size=(new_h, new_w), mode="bicubic", align_corners=False,
                                                antialias=True)
    mean = torch.tensor(spec.image_mean) * (1.0 / spec.rescale_factor)
    std = torch.tensor(spec.image_std) * (1.0 / spec.rescale_factor)
    video = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    t, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -n % t:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    grid_t, grid_h, grid_w = video.shape[0] // t, new_h // p, new_w // p
    patches = video.view(grid_t, t, 3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t * grid_h * grid_w, 3 * t * p * p)
    times = [index / clip.fps for index in clip.indices + [clip.indices[-1]] * pad]
    group_seconds = [(times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t)]
    sampled_fps = len(clip.indices) / clip.total * clip.fps  # transformers' VideoMetadata.sampled_fps
    return Video(patches.contiguous(), torch.tensor([grid_t, grid_h, grid_w]), group_seconds, t / sampled_fps)


def expand_video(video: Video, spec: VideoSpec, tokens: tuple[str, str, str]) -> str:
    """The text a ``<video>`` placeholder becomes: the vision start, video and vision end tokens
    (``tokens``) as the family's processor lays them out. Qwen2-VL / Qwen2.5-VL: start, one video
    token per visual token, end. Qwen3-VL: inside the outer start and end, each temporal group's
    ``<t.t seconds>`` and its own start, visual tokens and end."""
    start, pad, end = tokens
    t, h, w = (int(x) for x in video.grid)
    per_group = h * w // (spec.merge_size * spec.merge_size)
    if (spec.layout or spec.family) == "qwen2":
        return start + pad * (t * per_group) + end
    return start + "".join(f"<{s:.1f} seconds>" + start + pad * per_group + end for s in video.group_seconds) + end


def video_spec_for(config, source: str | Path | None = None, **overrides: Any) -> VideoSpec | None:
    """The video processor of a vision-language model as a :class:`VideoSpec`; None where the model
    type has no video processor odb knows (the families of :data:`VIDEO_FAMILIES`).

    Args:
        config: the model's transformers config.
        source: a model folder: its ``video_preprocessor_config.json``, else its
            ``preprocessor_config.json`` (transformers' own fallback), over the family's defaults;
            None or a config JSON: the defaults with the vision tower's geometry.
        overrides: the data config's ``fps``, ``num_frames``, ``min_frames``, ``max_frames``,
            ``min_pixels``, ``max_pixels``, ``max_video_tokens`` with ``cap_pixels_per_frame`` (None
            keeps the processor's).

    Raises:
        ValueError: the processor's geometry differs from the vision tower's, or the bounds are inverted.
    """
    layout = _FAMILY.get(getattr(config, "model_type", ""))
    vision = getattr(config, "vision_config", None)
    if layout is None or vision is None:
        return None
    folder = Path(source) if source is not None and Path(source).is_dir() else None
    own = _folder_settings(folder) if folder is not None else {}
    family = _processor_family(own) or layout
    settings = dict(VIDEO_FAMILIES[family])
    if not own:  # no processor settings: the family's defaults with the vision tower's geometry
        settings.update(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size)
    size = own.get("size") or {}
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    if family == "qwen2":  # Qwen2VLVideoProcessor's __init__ lets min_pixels / max_pixels override size
        low, high = own.get("min_pixels", low), own.get("max_pixels", high)
    for key, value in (("min_pixels", low), ("max_pixels", high)):
        if value is not None:
            settings[key] = int(value)
    for key in ("image_mean", "image_std"):
        if own.get(key) is not None:
            settings[key] = tuple(float(v) for v in own[key])
    for key in ("rescale_factor", "patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames",
                "fps", "num_frames", "cap_pixels_per_frame", "max_video_tokens"):
        if own.get(key) is not None:
            settings[key] = own[key]
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("num_frames") is not None:
        settings["fps"] = None  # the data config's frame count wins over the processor's rate
    elif overrides.get("fps") is not None:
        settings["num_frames"] = None  # and its rate over the processor's frame count
    for key, tower in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                       ("merge_size", "spatial_merge_size")):
        if getattr(vision, tower, settings[key]) != settings[key]:
            raise ValueError(f"the video processor of {folder or config.model_type} has {key} {settings[key]} but "
                             f"the vision tower has {tower} {getattr(vision, tower)}: fix the model's "
                             "video_preprocessor_config.json")
    if settings["min_pixels"] > settings["max_pixels"]:
        raise ValueError(f"need video min_pixels <= max_pixels, got {settings['min_pixels']} > "
                         f"{settings['max_pixels']} (the data config's video_min_pixels / video_max_pixels)")
    if settings["num_frames"] is not None and settings["num_frames"] < settings["temporal_patch_size"]:
        raise ValueError(f"video num_frames {settings['num_frames']} is under one group of "
                         f"{settings['temporal_patch_size']} frames (the data config's video_num_frames)")
    if settings["min_frames"] > settings["max_frames"]:
        raise ValueError(f"need video min_frames <= max_frames, got {settings['min_frames']} > "
                         f"{settings['max_frames']} (the data config's video_min_frames / video_max_frames)")
    return VideoSpec(family=family, layout=layout, seconds=config.model_type == "qwen2_5_vl",
                     cap_pixels_per_frame=bool(settings.pop("cap_pixels_per_frame", False)), **settings)


def _processor_family(own: dict[str, Any]) -> str | None:
    """The family of the video processor class transformers' ``AutoVideoProcessor`` picks from these
    settings: their ``video_processor_type``, else their image processor's type with "Image" read as
    "Video"; None: neither names a family odb knows (the model type decides)."""
    name = own.get("video_processor_type")
    if name is None and own.get("image_processor_type"):
        name = own["image_processor_type"].replace("ImageProcessor", "VideoProcessor")
    return {cls: family for family, cls in _CLASSES.items()}.get(name)


def _folder_settings(folder: Path) -> dict[str, Any]:
    """The folder's video processor settings, where transformers looks: ``processor_config.json``'s
    ``video_processor``, ``video_preprocessor_config.json``, else its image processor's."""
    if (folder / "processor_config.json").is_file():
        nested = json.loads((folder / "processor_config.json").read_text()).get("video_processor")
        if isinstance(nested, dict):
            return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return {}
