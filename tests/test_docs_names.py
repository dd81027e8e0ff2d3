"""Every command, flag and config key that README.md and docs/*.md name exists in the code.

Parsed out of the markdown text (no command is run, so this is fast):
  (a) `opid-<name>` words: console scripts in setup.py's entry_points;
  (b) `--flags` that follow an `opid-<name>` command in a code block or an inline code span: defined (as a string
      literal) in the source of the module the entry point names;
  (c) `python tools/x.py --flag` / `python examples/x.py`: the script exists and defines the flag;
  (d) `section.key[.sub...]` where `section` is a field of `opid_mega.config.Config`: resolves through the
      dataclasses (a dict-typed field accepts any sub-key), `key=value` overrides included.
One failure lists every bad name with file:line.
"""
import dataclasses
import glob
import os
import re
import typing

from opid_mega import config as config_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_COMMANDS = {"opid-mega"}  # the project's name, not a command
# `section.name` words that are file names or Python attributes, not config keys
FILE_EXTENSIONS = {"json", "jsonl", "log", "py", "yaml", "yml", "txt", "md", "png", "pt", "sh", "safetensors", "bak",
                   "tmp", "old"}


def _doc_files():
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return [f for f in files if os.path.exists(f)]


def _entry_points():
    """{command: module file} from setup.py's console_scripts."""
    text = open(os.path.join(ROOT, "setup.py")).read()
    out = {}
    for name, module in re.findall(r"[\"'](opid-[\w-]+)\s*=\s*([\w.]+):\w+[\"']", text):
        out[name] = os.path.join(ROOT, *module.split(".")) + ".py"
    assert out, "no opid-* console_scripts found in setup.py"
    return out


def _code_lines(text):
    """(line number, code text) for every line of a fenced block (continuations joined) and every inline span."""
    out = []
    lines = text.splitlines()
    in_block, pending, pending_no = False, "", 0
    for no, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            if pending:
                pending += " " + line.strip()
            else:
                pending, pending_no = line, no
            if pending.rstrip().endswith("\\"):
                pending = pending.rstrip()[:-1]
                continue
            out.append((pending_no, pending))
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                out.append((no, span))
    return out


def _command_flags(code):
    """[(command, flag)] for the flags after each opid-* command in one line of code."""
    out = []
    parts = re.split(r"(?<![\w-])(opid-[a-z]+)\b", code)
    # parts: [before, cmd1, args1, cmd2, args2, ...]
    for i in range(1, len(parts) - 1, 2):
        cmd, args = parts[i], parts[i + 1]
        args = re.split(r"&&|;|(?<!\\)\|\s|#|\s--\s", args)[0]  # up to the next shell command or comment
        out += [(cmd, f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args)]
    return out


def _script_flags(code):
    """[(script path, flag)] for `python tools/x.py --flag ...` / `python examples/x.py ...` in one line of code."""
    out = []
    parts = re.split(r"(?<![\w/.-])python3?\s+((?:tools|examples)/[\w/]+\.py)\b", code)
    for i in range(1, len(parts) - 1, 2):
        script, args = parts[i], parts[i + 1]
        args = re.split(r"&&|;|(?<!\\)\|\s|#|\s--\s", args)[0]
        out += [(script, f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args)] or [(script, None)]
    return out


def _hints(cls):
    return typing.get_type_hints(cls, vars(config_mod))


def _is_mapping(tp):
    origin = typing.get_origin(tp)
    if origin in (dict, typing.Dict) or tp in (dict, typing.Dict):
        return True
    if origin is typing.Union:
        return any(_is_mapping(a) for a in typing.get_args(tp))
    return tp is typing.Any


def _dataclass_of(tp):
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is typing.Union:
        for a in typing.get_args(tp):
            if dataclasses.is_dataclass(a):
                return a
    return None


def _resolve(path):
    """None when the dotted path is a config key, else why not."""
    cls = config_mod.Config
    for i, part in enumerate(path):
        hints = _hints(cls)
        if part.endswith("*"):
            found = any(name.startswith(part[:-1]) for name in hints)
            return None if found else f"no config key matches {'.'.join(path[:i + 1])}"
        if part not in hints:
            return f"{'.'.join(path[:i + 1])} is not a config key"
        tp = hints[part]
        sub = _dataclass_of(tp)
        if sub is not None:
            cls = sub
            continue
        if _is_mapping(tp) or i == len(path) - 1:
            return None
        return f"{'.'.join(path[:i + 1])} has no sub-keys"
    return None  # a whole section


def _config_keys(line, sections):
    sec = "|".join(sorted(sections, key=len, reverse=True))
    for m in re.finditer(rf"(?<![\w./\-$])({sec})((?:\.[a-z_][a-z0-9_]*)+)(?![\w(])", line):
        path = [m.group(1)] + m.group(2)[1:].split(".")
        if line[m.end():m.end() + 1] == "*":  # `algo.lambda_*`: a family of keys
            path[-1] += "*"
        if path[-1] in FILE_EXTENSIONS:
            continue
        yield m.group(0), path


def test_docs_name_only_what_exists():
    commands = _entry_points()
    sources = {cmd: open(f).read() for cmd, f in commands.items() if os.path.exists(f)}
    sections = set(_hints(config_mod.Config))
    bad = []
    for path in _doc_files():
        rel = os.path.relpath(path, ROOT)
        text = open(path).read()
        for no, line in enumerate(text.splitlines(), 1):
            for cmd in re.findall(r"(?<![\w/.-])(opid-[a-z]+)\b", line):
                if cmd not in NOT_COMMANDS and cmd not in commands:
                    bad.append(f"{rel}:{no}: command {cmd} is not in setup.py's console_scripts")
            for word, key in _config_keys(line, sections):
                why = _resolve(key)
                if why:
                    bad.append(f"{rel}:{no}: config key {word}: {why}")
        for no, code in _code_lines(text):
            for cmd, flag in _command_flags(code):
                if cmd in sources and f'"{flag}"' not in sources[cmd] and f"'{flag}'" not in sources[cmd]:
                    bad.append(f"{rel}:{no}: {cmd} has no flag {flag} ({os.path.relpath(commands[cmd], ROOT)})")
            for script, flag in _script_flags(code):
                full = os.path.join(ROOT, script)
                if not os.path.exists(full):
                    bad.append(f"{rel}:{no}: {script} does not exist")
                elif flag and f'"{flag}"' not in open(full).read() and f"'{flag}'" not in open(full).read():
                    bad.append(f"{rel}:{no}: {script} has no flag {flag}")
    assert not bad, "names in the docs that the code does not have:\n" + "\n".join(sorted(set(bad)))


def test_the_parser_finds_what_it_should():
    """The checks above catch a wrong command, flag and key (so a silent parser cannot pass the test)."""
    assert _command_flags("opid-train --config F --resume auto && opid-report runs/x --out P") == [
        ("opid-train", "--config"), ("opid-train", "--resume"), ("opid-report", "--out")]
    assert _command_flags("opid-train --resume auto \\| --overwrite") == [
        ("opid-train", "--resume"), ("opid-train", "--overwrite")]
    assert _script_flags("python tools/bench_logprob.py --preset ci --json out.json  # x --no") == [
        ("tools/bench_logprob.py", "--preset"), ("tools/bench_logprob.py", "--json")]
    assert _script_flags("sudo python tools/cluster_sim.py --nodes 2 -- env X=1 run.sh --config F") == [
        ("tools/cluster_sim.py", "--nodes")]
    assert _script_flags("python examples/megatron_lm_opid.py") == [("examples/megatron_lm_opid.py", None)]
    sections = set(_hints(config_mod.Config))
    keys = [w for w, _ in _config_keys("`train.loss_agg` and algo.loss_agg=token-mean, opid_mega.algo.delta_baseline,"
                                       " model.safetensors, env.options.process=false", sections)]
    assert keys == ["train.loss_agg", "algo.loss_agg", "env.options.process"]
    assert _resolve(["train", "loss_agg"]) and _resolve(["algo", "loss_agg"]) is None
    assert _resolve(["env", "options", "process"]) is None
    assert _resolve(["algo", "lambda_episode", "x"])
    assert _resolve(["algo", "lambda_*"]) is None and _resolve(["algo", "nothing_*"])
    assert "opid-with" not in _entry_points() and "opid-train" in _entry_points()
