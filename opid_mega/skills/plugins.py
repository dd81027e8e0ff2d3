"""Analyzer plug-ins: `analyzer.backend: "package.module:Class"` names a subclass of opid_mega.skills.Analyzer, built
with `analyzer.options` (the import-path machinery and its one-line errors: opid_mega.plugins; the protocol:
docs/custom_env.md)."""
from __future__ import annotations

from opid_mega.plugins import check_options, constructor_options, load_class
from opid_mega.skills.base import Analyzer

ANALYZER_BASE = "opid_mega.skills.Analyzer"


def analyzer_class(spec: str) -> type:
    """The analyzer class `analyzer.backend` names (a subclass of opid_mega.skills.Analyzer)."""
    return load_class(spec, "analyzer.backend", Analyzer, ANALYZER_BASE)


def analyzer_kwargs(cls: type, options: dict, max_step_skills: int) -> dict:
    """The constructor's keyword arguments: `analyzer.options`, plus max_step_skills (analyzer.max_step_skills)
    when the constructor has a parameter of that name and the options do not set it."""
    kwargs = dict(options)
    spec = constructor_options(cls)
    if "max_step_skills" not in kwargs and spec is not None and "max_step_skills" in spec[0]:
        kwargs["max_step_skills"] = max_step_skills
    return kwargs


def check_analyzer(backend: str, options: dict) -> None:
    """Config-load check of a plug-in analyzer: importable, an Analyzer subclass, options its constructor takes."""
    check_options(analyzer_class(backend), options, "analyzer.options", provided=("max_step_skills",), label=backend)


def build_analyzer(analyzer_cfg):
    """The plug-in analyzer of a config's `analyzer` section: Class(**analyzer.options) (see analyzer_kwargs)."""
    cls = analyzer_class(analyzer_cfg.backend)
    return cls(**analyzer_kwargs(cls, analyzer_cfg.options, analyzer_cfg.max_step_skills))
