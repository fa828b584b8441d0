"""Run configs: frozen objects composed of sections, filled in from YAML files and CLI flags.

- :mod:`.options`: the machinery (options, sections, YAML flat or by section, flags, env defaults);
- :mod:`.shared`: the sections the training and the federated configs share (dataset, audit, tracking);
- :mod:`.train`: :class:`TrainConfig` and its sections (:mod:`.scale`: the cluster section).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import options
from .options import ENV_DEFAULTS, Composed, Section, option
from .options import add_config_arguments as _add_arguments
from .shared import (
    AuditOptions,
    DatasetOptions,
    TrackingOptions,
    check_audit_options,
    check_dataset,
    check_model,
)
from .train import (
    OPTIMIZERS,
    AuditConfig,
    DataConfig,
    MethodConfig,
    ModelConfig,
    PrivacyConfig,
    ScaleConfig,
    TrainConfig,
    TrainTracking,
)

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
SECTIONS = (DataConfig, ModelConfig, PrivacyConfig, MethodConfig, AuditConfig, ScaleConfig, TrainTracking)


def config_from_dict(values: dict[str, Any], cls=TrainConfig):
    """A ``cls`` (TrainConfig by default) from plain values, flat or by section; see :mod:`.options`."""
    return options.config_from_dict(values, cls)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, cls=TrainConfig):
    """Defaults ← YAML file (if any) ← overrides (CLI flags)."""
    return options.load_config(path, overrides, cls)


def add_config_arguments(parser, cls=TrainConfig) -> None:
    """One flag per option, grouped by section."""
    _add_arguments(parser, cls)


__all__ = [
    "ENV_DEFAULTS",
    "FIELDS",
    "OPTIMIZERS",
    "SECTIONS",
    "AuditConfig",
    "AuditOptions",
    "Composed",
    "DataConfig",
    "DatasetOptions",
    "MethodConfig",
    "ModelConfig",
    "PrivacyConfig",
    "ScaleConfig",
    "Section",
    "TrackingOptions",
    "TrainConfig",
    "TrainTracking",
    "add_config_arguments",
    "check_audit_options",
    "check_dataset",
    "check_model",
    "config_from_dict",
    "load_config",
    "option",
]
