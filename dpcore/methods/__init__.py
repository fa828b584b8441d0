"""The training methods of the papers, as small objects (see :mod:`.base` for what a method may do).

* ``"dpsgd"`` (:class:`.base.Method`): Abadi et al. 2016.
* ``"bam"`` (:class:`.bam.BAM`): Knolle et al. 2023, per-example ascent before clipping.
* ``"dpsat"`` (:class:`.dpsat.DPSAT`): Park et al. 2023, one shift per lot along the last release.

Every option, and whether a combination is valid, is checked in one place:
:func:`.options.check_method_options`.
"""

from .bam import BAM
from .base import Method
from .dpsat import DPSAT
from .options import (
    ASCENT_SCHEDULES,
    BAM_VARIANTS,
    CLIP_NORM_TYPES,
    NOISE_KINDS,
    AscentArg,
    Schedule,
    bookkeeping_applies,
    check_method_options,
)
from .schedules import as_schedule, ascent_schedule

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Method, BAM, DPSAT)}


def make_method(name: str, ascent: AscentArg = 0.0, bam_variant: str = "sam") -> Method:
    check_method_options(method=name, ascent=ascent, bam_variant=bam_variant)
    return METHODS[name](ascent, bam_variant)


__all__ = [
    "ASCENT_SCHEDULES", "BAM", "BAM_VARIANTS", "CLIP_NORM_TYPES", "DPSAT", "METHODS", "Method", "NOISE_KINDS",
    "AscentArg", "Schedule", "as_schedule", "ascent_schedule", "bookkeeping_applies", "check_method_options",
    "make_method",
]  # fmt: skip
