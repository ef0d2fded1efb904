"""MkDocs hook: fill the generated reference pages from the code at build time.

A page holds a marker line such as ``<!-- generated: recipe-keys -->``; ``on_page_markdown`` replaces it
with Markdown built from bigtune itself, so the reference cannot drift from the code:

- ``recipe-keys``: every recipe key, a section per recipe block and an anchor per key (``recipe.md#train.max_steps``),
  from ``bigtune.recipe.schema_markdown(anchors=True)``;
- ``cli``: every command and flag, from the argparse parser (``bigtune.cli.build_parser``);
- ``exit-codes``: the exit codes the CLI defines;
- ``gpu-catalog``: the GPUs ``--gpu`` accepts, from the catalog (``bigtune.core.gpus``);
- ``modules``: every module of the package by layer, with its docstring's first paragraph;
- ``http-api``: the training service's routes, parameters, answers and models, from its OpenAPI schema
  (``bigtune.serve.api.openapi_schema``, what ``bigtune serve`` serves at /openapi.json).

The hook imports bigtune, so build the site from an environment where it is installed (``pip install -e
'.[docs]'``, which brings FastAPI and SQLAlchemy for the service's schema).
"""

from __future__ import annotations

import argparse
import re

MARKER = re.compile(r"^<!--\s*generated:\s*([a-z0-9-]+)\s*-->\s*$", re.MULTILINE)


def _recipe_keys() -> str:
    from bigtune.recipe import schema_markdown

    text = schema_markdown(anchors=True)
    # The page has its own title and introduction: drop the generated H1 and keep the index and the sections.
    lines = text.splitlines()
    while lines and (lines[0].startswith("# ") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines) + "\n"


def _root_parser() -> argparse.ArgumentParser:
    from bigtune.cli import build_parser

    return build_parser()


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                if isinstance(metavar, tuple):
                    metavar = " ".join(metavar)
                name += f" `{metavar}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        help_text = action.help if action.help not in (None, argparse.SUPPRESS) else ""
        if help_text and "%(" in help_text:
            help_text = help_text % {"default": action.default, "prog": parser.prog}
        extra = []
        if action.required and action.option_strings:
            extra.append("required")
        if (
            action.option_strings
            and action.nargs != 0
            and action.default not in (None, [], False, "")
            and "default" not in (help_text or "")
        ):
            extra.append(f"default `{action.default}`")
        if action.choices:
            extra.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
        if isinstance(action, argparse._AppendAction) and "repeatable" not in (help_text or ""):
            extra.append("repeatable")
        text = _cell(help_text)
        if extra:
            text = (text + " " if text else "") + "(" + "; ".join(extra) + ")"
        rows.append(f"| {name} | {text} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="usage: ")
    return formatter.format_help().strip()


def _cli() -> str:
    root = _root_parser()
    out = [f"```text\n{_usage(root)}\n```", "", _cell(root.description or ""), ""]
    commands = list(_subcommands(root))
    out += ["| command | what it does |", "|---|---|"]
    out += [f"| [`bigtune {name}`](#bigtune-{name}) | {_cell(help_)} |" for name, help_, _ in commands]
    out += ["", "Options of `bigtune` itself:", "", "| argument | meaning |", "|---|---|", *_flag_rows(root), ""]
    for name, help_, sub in commands:
        out += [
            f"## `bigtune {name}` {{#bigtune-{name}}}",
            "",
            _cell(help_) + ("." if help_ and not help_.endswith(".") else ""),
            "",
        ]
        if sub.description:
            out += [_cell(sub.description), ""]
        out += [f"```text\n{_usage(sub)}\n```", ""]
        rows = _flag_rows(sub)
        if rows:
            out += ["| argument | meaning |", "|---|---|", *rows, ""]
        for sub_name, sub_help, subsub in _subcommands(sub):  # nested verbs, if any
            out += [
                f"### `bigtune {name} {sub_name}`",
                "",
                _cell(sub_help),
                "",
                f"```text\n{_usage(subsub)}\n```",
                "",
                "| argument | meaning |",
                "|---|---|",
                *_flag_rows(subsub),
                "",
            ]
    return "\n".join(out) + "\n"


def _exit_codes() -> str:
    from bigtune.cli import app as cli_main

    modules = [cli_main]

    names = {
        "EXIT_OK": "success",
        "EXIT_ERROR": "unexpected error (a bug, or a failure bigtune did not foresee); the traceback is printed",
        "EXIT_BAD_INPUT": "bad input: recipe, data, model or arguments; one message, nothing written",
        "EXIT_OOM": "out of memory; `summary.json` records where",
        "EXIT_INTERRUPTED": "stopped by Ctrl-C (SIGINT) after writing a checkpoint; resume with `--resume`",
        "EXIT_PREEMPTED": "stopped by SIGTERM after writing a checkpoint; resume with `--resume` or `--auto-resume`",
    }
    rows = ["| code | constant | meaning |", "|---|---|---|"]
    for const, meaning in names.items():
        value = next((getattr(m, const) for m in modules if hasattr(m, const)), None)
        if value is None:
            raise RuntimeError(f"bigtune.cli.app.{const} is missing; update docs/_hooks/gen.py")
        rows.append(f"| `{value}` | `{const}` | {meaning} |")
    return "\n".join(rows) + "\n"


def _gpu_catalog() -> str:
    from bigtune.core.gpus import CATALOG as catalog

    def num(v, fmt="{:g}"):
        return "-" if v is None else fmt.format(v)

    rows = [
        "| `--gpu` key | GPU | memory (GiB) | bf16 TFLOP/s | fp32 TFLOP/s | memory GB/s | link | also accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, g in catalog.items():
        aliases = ", ".join(f"`{a}`" for a in g.aliases if " " not in a and a != key)
        rows.append(
            f"| `{key}` | {_cell(g.name)} | {num(g.memory_gib)} | {num(g.bf16_tflops)} | {num(g.fp32_tflops)} "
            f"| {num(g.mem_bandwidth_gbs)} | {_cell(g.interconnect)} | {aliases} |"
        )
    return "\n".join(rows) + "\n"


LAYERS = ("core", "recipe", "data", "models", "memory", "engine", "plan", "run", "sweep", "use", "serve", "cli")


def _modules() -> str:
    """Every module of the package, layer by layer, with the first sentence of its docstring (read from
    the source, not imported)."""
    import ast
    from pathlib import Path

    import bigtune

    root = Path(bigtune.__file__).resolve().parent
    rows = ["| layer | module | what it holds |", "|---|---|---|"]
    for layer in LAYERS:
        path = root / f"{layer}.py"
        files = [path] if path.is_file() else sorted((root / layer).glob("*.py"))
        for f in files:
            if f.name == "__init__.py" and len(files) > 1:
                continue
            doc = ast.get_docstring(ast.parse(f.read_text())) or ""
            first = " ".join(doc.split("\n\n")[0].split())
            name = "bigtune." + ".".join(f.relative_to(root).with_suffix("").parts)
            rows.append(f"| `{layer}` | `{name}` | {_cell(first)} |")
    return "\n".join(rows) + "\n"


def _schema_type(schema: dict) -> str:
    """A JSON schema's type in words: ``integer``, ``string or null``, ``list of`` [`JobView`](#jobview)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_type(s) for s in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return "list of " + _schema_type(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "mapping to " + _schema_type(schema["additionalProperties"])
    if kind == "object":
        return "object"
    return str(kind)


def _limits(schema: dict) -> str:
    words = [f"{k} {schema[k]}" for k in ("minimum", "maximum") if k in schema]
    if "default" in schema:
        words.append(f"default `{schema['default']}`")
    return "; ".join(words)


def _http_api() -> str:
    """Each route (method, path, what it does, its parameters, body and answers), then each model's fields, from
    the service's OpenAPI schema."""
    from bigtune.serve.api import openapi_schema

    spec = openapi_schema()
    routes = [(path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()]
    out = ["| route | what |", "|---|---|"]
    anchors = {}
    for path, method, op in routes:
        anchors[(path, method)] = re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
        first = (op.get("description") or op.get("summary") or "").split("\n")[0]
        out.append(f"| [`{method.upper()} {path}`](#{anchors[(path, method)]}) | {_cell(first)} |")
    out += ["", "## Routes", ""]
    for path, method, op in routes:
        out += [
            f"### `{method.upper()} {path}` {{#{anchors[(path, method)]}}}",
            "",
            _cell(op.get("description", "")),
            "",
        ]
        params = [p for p in op.get("parameters", []) if p["name"] != "authorization"]
        if params:
            out += ["| parameter | in | type | meaning |", "|---|---|---|---|"]
            for prm in params:
                sch = prm.get("schema", {})
                extra = "; ".join(w for w in ("required" if prm.get("required") else "", _limits(sch)) if w)
                out.append(
                    f"| `{prm['name']}` | {prm['in']} | {_schema_type(sch)} | {_cell(prm.get('description', extra))} |"
                )
            out.append("")
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if body:
            out += [f"Body: {_schema_type(body)} (JSON).", ""]
        out += ["| answer | body | when |", "|---|---|---|"]
        for status, res in op.get("responses", {}).items():
            sch = res.get("content", {}).get("application/json", {}).get("schema")
            out.append(f"| {status} | {_schema_type(sch) if sch else '-'} | {_cell(res.get('description', ''))} |")
        out.append("")
    out += ["## Models", ""]
    for name, sch in spec.get("components", {}).get("schemas", {}).items():
        out += [f"### `{name}` {{#{name.lower()}}}", ""]
        if sch.get("description"):
            out += [_cell(sch["description"]), ""]
        props = sch.get("properties", {})
        if props:
            out += ["| field | type | meaning |", "|---|---|---|"]
            required = set(sch.get("required", []))
            for field, fs in props.items():
                extra = "; ".join(w for w in ("required" if field in required else "", _limits(fs)) if w)
                text = " ".join(w for w in (_cell(fs.get("description", "")), f"({extra})" if extra else "") if w)
                out.append(f"| `{field}` | {_schema_type(fs)} | {text} |")
            out.append("")
    return "\n".join(out) + "\n"


GENERATORS = {
    "recipe-keys": _recipe_keys,
    "cli": _cli,
    "exit-codes": _exit_codes,
    "gpu-catalog": _gpu_catalog,
    "modules": _modules,
    "http-api": _http_api,
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        kind = match.group(1)
        if kind not in GENERATORS:
            raise KeyError(f"{page.file.src_path}: unknown generated block {kind!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[kind]()

    return MARKER.sub(replace, markdown)
