import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
BUNDLED = ("configs", "data/tokenizer", "data/vl_tokenizer", "data/chat.jsonl", "launch/train.py",
           "launch/slurm.sbatch")
"""What an installed odb carries besides its code, copied into the package as odb/_bundled by the
build (the checkout's own files stay where they are; odb.recipe.bundled_root finds either):
the default configs and the recipes (configs/recipes: `odb train demo`), the demo's tiny model
configs, the bundled tokenizer and the tiny VL model's (data/vl_tokenizer: the same plus
<|video_pad|>), the bundled chat data (data/chat.jsonl whole: 2000 chats, 1.7 MB;
data/mm, the multimodal sample, stays in the checkout), and launch/slurm.sbatch with the
launch/train.py it runs (ODB_REPO=$(odb path))."""


class BuildWithBundle(build_py):
    """build_py, then the :data:`BUNDLED` files into the built package's odb/_bundled (not for an
    editable install, which reads the checkout's own)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "odb" / "_bundled"
        shutil.rmtree(target, ignore_errors=True)  # (an earlier build's copy: no file outlives its source)
        for name in BUNDLED:
            source, copy = HERE / name, target / name
            copy.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, copy)


setup(
    name="odb",
    version="0.1.0",
    description="Online Dynamic Batching for DeepSpeed LLM fine-tuning: packed, token-budgeted "
                "micro-batches formed after processing, with data-parallel ranks kept aligned",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["odb", "odb.*"]),
    cmdclass={"build_py": BuildWithBundle},
    entry_points={"console_scripts": ["odb=odb.cli:main"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        # A range: users bring the build for their GPUs (CI pins the CPU wheel). The floor is the oldest
        # release everything odb calls has (odb/training/run/startup.py refuses older ones at start, naming it):
        # transformers 5.24 disables torch < 2.6; FSDP2's fully_shard / FSDPModule / MixedPrecisionPolicy
        # are public in torch.distributed.fsdp from 2.6; SDPA's enable_gqa (odb's CPU path) is 2.5;
        # DCP's StateDictOptions(broadcast_from_rank0=) is 2.4; DeepSpeed 0.17+ asks torch>=2.0, PEFT
        # torch>=1.13. On GPUs without flash-attn, torch's own varlen_attn (2.9+) is what odb packs with;
        # an older torch packs through per-group SDPA (attention_path names the path at start).
        "torch>=2.6",
        "deepspeed>=0.17",
        "transformers>=5.20,<6",
        "tokenizers>=0.21",
        "peft>=0.17",
        "tqdm>=4.60",
        "datasets>=3.0",  # Parquet sources (local files only)
        "pillow>=10",  # images for multimodal samples
        "pyyaml>=6",  # recipes and YAML configs
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "matplotlib>=3.7",
                "wandb>=0.19", "tensorboard>=2.14", "mlflow-skinny>=2.10",  # --report_to's trackers
                "psutil>=5.9",  # tests/launch.py watches the launcher's processes (deepspeed needs it too)
                "accelerate>=1.16", "trl>=1.16",  # odb.integrations' hosts (tests/e2e/test_integrations.py)
                "av>=18",  # videos (odb/data/videos.py)
                "ruff>=0.6"],
        # odb inside HF Trainer / TRL / Accelerate (odb.integrations): the versions tested here
        "hf": ["accelerate>=1.16", "trl>=1.16"],
        "wandb": ["wandb>=0.19"],
        "tensorboard": ["tensorboard>=2.14"],  # (through torch.utils.tensorboard)
        "mlflow": ["mlflow-skinny>=2.10"],  # logging only; the full mlflow package has the UI and server
        "gpu": ["flash-attn>=2.6"],
        "video": ["av>=18"],  # video files (PyAV, which carries FFmpeg); frame images need only pillow
        "plot": ["matplotlib>=3.7"],  # odb plot
    },
)
