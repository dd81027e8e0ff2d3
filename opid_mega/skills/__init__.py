"""The skill layer: analyses, analyzer prompts, the lenient parser, skill injection, analyzers."""
from opid_mega.skills.base import Analyzer
from opid_mega.skills.injection import (
    CLOSING_ANCHOR,
    inject_skill,
    inject_skills,
    insertion_point,
    insertion_points,
    render_skill_section,
    split_prompt,
)
from opid_mega.skills.parser import parse_analysis
from opid_mega.skills.prompts import build_analysis_prompt, build_reask_prompt, discounted_returns
from opid_mega.skills.rules import RuleAnalyzer
from opid_mega.skills.types import Analysis, AnalysisParseError, StepView, TrajectoryView

__all__ = [
    "Analysis",
    "AnalysisParseError",
    "Analyzer",
    "CLOSING_ANCHOR",
    "RuleAnalyzer",
    "StepView",
    "TrajectoryView",
    "build_analysis_prompt",
    "build_reask_prompt",
    "discounted_returns",
    "inject_skill",
    "inject_skills",
    "insertion_point",
    "insertion_points",
    "parse_analysis",
    "render_skill_section",
    "split_prompt",
]
