"""The machinery every run config shares: options with help texts, sections, YAML and flags.

A config is a frozen dataclass composed of *sections*: small frozen dataclasses that each
declare their own options (``option(default, help)``) and check them (``check()``). The
composed class inherits from its sections, so an option is read flat (``cfg.lr``), as YAML
keys and CLI flags name it, and a section can be taken out whole (``cfg.section(PrivacyConfig)``)
for code that needs only that part. A YAML file may give options flat or under their section's
name (``privacy: {target_epsilon: 3}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import dpcore

S = TypeVar("S")


def close_names(name: str, names, n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` that ``name`` may have meant: near spellings first, then names
    that share its first word (``target_eps`` → target_epsilon, target_delta)."""
    names = list(names)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.75)
    first = name.lstrip("-").replace("-", "_").split("_")[0]
    close += [m for m in names if m.lstrip("-").replace("-", "_").split("_")[0] == first and m not in close]
    return close[:n]


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" error names the flags meant
    (``--epoch`` → did you mean --epochs?)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):  # a subcommand's leftovers come here too
            parsers = [self] + [
                sub for a in self._actions if isinstance(a, argparse._SubParsersAction) for sub in a.choices.values()
            ]
            flags = list(dict.fromkeys(s for p in parsers for s in p._option_string_actions if s.startswith("--")))
            for word in message.split(":", 1)[1].split():
                close = close_names(word.split("=")[0], flags) if word.startswith("--") else []
                if close:
                    message += f"\n  {word.split('=')[0]}: did you mean {' or '.join(close)}?"
        super().error(message)


def option(default, help: str, group: str | None = None, choices=None, flag: bool = True):
    """One option: its default and the help text the CLI shows. ``group`` overrides the
    section's name as the heading of its flag in ``--help``; ``choices`` lets the flag refuse
    anything else; ``flag=False`` keeps it out of the command line (YAML only)."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, "flag": flag})


class Section:
    """Base of a config section: a frozen dataclass of options with one ``check``."""

    SECTION: ClassVar[str] = ""

    def check(self) -> None:
        """Raise DPConfigError naming the value and the fix; the default checks nothing."""

    @classmethod
    def own_fields(cls) -> list[str]:
        """The options this section declares itself (not those of the sections it extends)."""
        inherited = {f.name for b in cls.__bases__ if dataclasses.is_dataclass(b) for f in dataclasses.fields(b)}
        return (
            [f.name for f in dataclasses.fields(cls) if f.name not in inherited]
            if dataclasses.is_dataclass(cls)
            else []
        )


class Composed:
    """Mixin of a config composed of sections: section access, checks, and dicts."""

    def section(self, cls: type[S]) -> S:
        """The typed section ``cls`` holding this config's values of its options."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def check_sections(self) -> None:
        """Each section's own ``check``, once (in declaration order)."""
        done: set = set()
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("check")
            if issubclass(cls, Section) and check is not None and check not in done:
                done.add(check)
                check(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def section_of(cls) -> dict[str, str]:
    """option name → the heading it is listed under (its group, else its section's name)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, Section):
            for name in base.own_fields():
                out[name] = base.SECTION
    for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
            out[f.name] = f.metadata["group"]
    return out


# -- checks shared by the sections -----------------------------------------------------------------


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


def check_positive_number(cfg, *names: str, allow_zero: bool = False) -> None:
    """Each option in ``names`` is a finite number > 0 (≥ 0 with ``allow_zero``)."""
    for name in names:
        v = getattr(cfg, name)
        if not _is_number(v) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            bound = "≥ 0" if allow_zero else "> 0"
            raise dpcore.DPConfigError(f"{name}={v!r} is invalid: it must be a finite number {bound}.")


def check_count(cfg, *names: str) -> None:
    """Each option in ``names`` is an integer ≥ 0."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise dpcore.DPConfigError(f"{name}={v!r} is invalid: it must be an integer ≥ 0.")


def check_storage_path(cfg) -> None:
    """``storage_path`` is a folder of a filesystem, not a URL."""
    if "://" in cfg.storage_path:
        raise dpcore.DPConfigError(
            f"storage_path={cfg.storage_path!r}: only filesystem paths are supported (local, or a shared mount "
            "such as NFS on a cluster): the ledger journal needs POSIX append, fsync and locks."
        )


def check_choice(cfg, name: str, choices) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        raise dpcore.DPConfigError(f"{name}={v!r} is unknown; available: {', '.join(choices)}.")


def check_seed(cfg) -> None:
    if cfg.seed is not None and (isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0):
        raise dpcore.DPConfigError(f"seed={cfg.seed!r} is invalid: a seed must be a non-negative integer.")


# -- values in, flags out ----------------------------------------------------------------------------


def _coerce(name: str, value: Any, fields: dict) -> Any:
    """YAML/JSON values → the field's type (ints for int fields, floats for float fields)."""
    t = str(fields[name].type)
    if value is None:
        if "None" in t:
            return None
        raise dpcore.DPConfigError(f"{name}: null is not allowed.")
    try:
        if t.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if t.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if t.startswith("float"):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if t.startswith("str | float"):  # a word (e.g. "auto") or a number, kept as a float
            if isinstance(value, bool):
                raise TypeError
            try:
                return float(value)
            except (TypeError, ValueError):
                return str(value)
        return str(value)
    except (TypeError, ValueError):
        raise dpcore.DPConfigError(f"{name}={value!r} has the wrong type: expected {t}.") from None


# Options whose default comes from the environment when it is set (a cluster's nodes carry them,
# e.g. from `dp-platform stack` or a Kubernetes Secret); a YAML file or a flag still wins.
ENV_DEFAULTS = {"tracking_uri": "MLFLOW_TRACKING_URI", "storage_path": "DP_STORAGE_PATH"}


def _flatten(values: dict[str, Any], headings: dict[str, str]) -> dict[str, Any]:
    """Accept options flat or under their section's name (``privacy: {target_epsilon: 3}``)."""
    flat: dict[str, Any] = {}
    sections = set(headings.values())
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if isinstance(value, dict) and name in sections:
            for k, v in value.items():
                inner = str(k).replace("-", "_")
                if headings.get(inner) != name:
                    where = f" (it belongs to section {headings[inner]!r})" if inner in headings else ""
                    raise dpcore.DPConfigError(f"section {name!r} has no option {k!r}{where}. See --help for the list.")
                flat[inner] = v
        else:
            flat[name] = value
    return flat


def config_from_dict(values: dict[str, Any], cls):
    """A ``cls`` (a frozen config dataclass built from sections) from plain values, flat or by
    section, with types checked and unknown keys refused. Options in :data:`ENV_DEFAULTS` that
    are not given default to their environment variable when it is set."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = _flatten(values, section_of(cls))
    values = {
        **{n: os.environ[v] for n, v in ENV_DEFAULTS.items() if n in fields and n not in values and os.environ.get(v)},
        **values,
    }
    clean = {}
    for name, value in values.items():
        if name not in fields:
            close = close_names(name, fields)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise dpcore.DPConfigError(f"unknown config key {name!r}.{hint} See --help for the list.")
        clean[name] = _coerce(name, value, fields)
    return cls(**clean)


def load_config(path: str | Path | None, overrides: dict[str, Any] | None, cls):
    """Defaults ← YAML file (if any) ← overrides (CLI flags)."""
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise dpcore.DPConfigError(f"config file {str(p)!r} does not exist.")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise dpcore.DPConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise dpcore.DPConfigError(f"config file {p} must hold a mapping of option: value.")
        values.update(_flatten(loaded, section_of(cls)))
    values.update(overrides or {})
    return config_from_dict(values, cls)


def add_config_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per option, grouped by section, with the option's help. Defaults are SUPPRESSed
    so that only the flags a user gives override the YAML file."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    headings = section_of(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flag", True):
            continue
        g = headings[f.name]
        if g not in groups:
            groups[g] = parser.add_argument_group(g)
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        helptext = f.metadata["help"]
        if "default" not in helptext.lower() and f.default is not None:  # never "(default 8) (default: None)"
            helptext += f" (default: {f.default})"
        if t.startswith("bool"):
            groups[g].add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=helptext
            )
        else:
            kind = int if t.startswith("int") else float if t.startswith("float") else str
            choices = f.metadata.get("choices")
            groups[g].add_argument(
                flag,
                type=kind,
                default=argparse.SUPPRESS,
                help=helptext,
                **({"choices": choices} if choices else {"metavar": f.name.upper()}),
            )


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command's parser with the YAML CONFIG argument; add the options with
    :func:`add_config_arguments`."""
    p = Parser(
        prog=prog,
        description=description,
        epilog="Options come from the defaults, then the YAML CONFIG file, then these flags.",
    )
    p.add_argument("config", nargs="?", help="YAML file of options (keys as the flags with _ or -, flat or by section)")
    return p
