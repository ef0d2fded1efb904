"""bigtune: fine-tune models that do not fit, and know where the memory goes.

Python API (mirrors the CLI; heavy libraries load on first use)::

    import bigtune
    summary = bigtune.train("recipes/tinyllama-full.yaml", overrides=["train.micro_batch_size=8"])
    recipe = bigtune.load_recipe(None, {"precision": "bf16-true"})
"""

__version__ = "0.1.0"

__all__ = ["train", "load_recipe", "Recipe", "RecipeError", "__version__"]

import logging as _logging

# bitsandbytes' CPU backend warns on import, on CPUs with AVX512-BF16, that an optional fused 4-bit kernel from
# the `kernels` package is missing and tells the user to install it; it then uses its own kernel, which is what
# bigtune tests and plans with. The advice is not ours to give, so its logger is quieted to errors.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# torchao (optional extra; transformers and peft import it whenever it is installed) logs one line per CUDA/cutlass
# kernel library it cannot load on a CPU build, and its Enum registrations make torch's pytree log a deprecation
# per Enum. Neither is actionable for a bigtune user; the NF4 weights bigtune uses need none of those kernels.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

import warnings as _warnings  # noqa: E402

# Lightning warns on every start, on any machine where Slurm's `srun` is installed (a cluster's login node, a
# workstation with Slurm), that it is "available but not used". bigtune's Slurm jobs (`bigtune launch slurm`) run
# under srun; a run started by hand is meant to run where it is, so the hint only misleads.
_warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")


def __getattr__(name):
    # Lazy so that `import bigtune` and `bigtune --help` stay fast (Lightning alone takes seconds).
    if name == "train":
        from bigtune.run.training import train

        return train
    if name in ("load_recipe", "Recipe", "RecipeError"):
        from bigtune import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'bigtune' has no attribute {name!r}")
