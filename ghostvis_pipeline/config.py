"""Dagster Config classes derived from the core's dataclasses, so a default is declared once (in core)."""

from __future__ import annotations

import dataclasses
import typing

import pydantic
from dagster import Config


def config_from_dataclass(cls: type, doc: str | None = None) -> type[Config]:
    """A `dagster.Config` subclass named `<cls>Config` with `cls`'s fields, types and defaults."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = pydantic.Field(default_factory=f.default_factory)
        else:
            default = ...
        fields[f.name] = (hints[f.name], default)
    model = pydantic.create_model(f"{cls.__name__}Config", __base__=Config, **fields)
    model.__doc__ = doc or cls.__doc__
    return model
