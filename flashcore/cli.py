"""The flashcore command: compile, dump, precompile, cache, catalog-hash, info.

Every verb has ``--help``. Bad flags give a usage error (exit 2); a bad spec, a folder that
cannot be used and any other error give a one-line message naming the problem (exit 2), never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from . import __version__
from .errors import FlashcoreError, SpecError
from .specs import ARCHS, AttentionSpec, TileConfig


class CliError(FlashcoreError):
    """A command-line argument names something that cannot be used (a folder, a file)."""

# -- spec flags, generated from the spec's fields ------------------------------------------------
# Flag spellings kept from earlier releases
_ALIASES = {"return_lse": ["--lse"]}


def _spec_fields() -> list[dataclasses.Field]:
    """The fields a user sets: the spec's (but ``op``), with ``config`` expanded into TileConfig's."""
    out = []
    for f in dataclasses.fields(AttentionSpec):
        if f.name == "config":  # the spec's --family names the family
            out += [c for c in dataclasses.fields(TileConfig) if c.metadata.get("cli", True)]
        elif f.metadata.get("cli", True):
            out.append(f)
    return out


def _field_type(f: dataclasses.Field) -> str:
    """"bool", "int", "str" or "tile" (a pair of ints), from the field's default."""
    if f.name == "tile":
        return "tile"
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int) or f.name == "warps":
        return "int"
    return "str"


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    for f in _spec_fields():
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        kind, help_ = _field_type(f), f.metadata.get("help")
        if kind == "bool":
            p.add_argument(*flags, dest=f.name, action="store_true", help=help_)
        elif kind == "tile":
            p.add_argument(*flags, dest=f.name, type=int, nargs=2, metavar=("M", "N"),
                           default=None, help=f"{help_} (default 64 64)")
        else:
            choices = f.metadata.get("choices")
            p.add_argument(*flags, dest=f.name, type=int if kind == "int" else str,
                           choices=choices, default=None,
                           help=f"{help_} (default {f.default})" if f.default not in
                           (None, "", dataclasses.MISSING) else help_)


def _spec_from(a: argparse.Namespace):
    """The spec of ``--spec`` (any kernel's JSON: the combine, the quantisers, the backward's,
    the KV-cache append), else of the attention flags."""
    if getattr(a, "spec", None):
        return _spec_json(a.spec)
    return _spec_from_values({f.name: getattr(a, f.name) for f in _spec_fields()})


def _spec_json(text: str):
    """A spec from JSON text, or from the file it names (a dump's spec.json)."""
    from .specs import spec_from_dict

    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as e:
            raise SpecError(f"--spec {text!r}: not JSON and not a readable file ({e})") from None
    try:
        d = json.loads(source)
    except json.JSONDecodeError as e:
        raise SpecError(f"--spec: not valid JSON: {e}") from None
    return spec_from_dict(d)


def _add_spec_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, metavar="JSON",
                   help="any kernel's spec as JSON text or a JSON file (e.g. a dump's "
                   "spec.json; its op picks the kernel); the attention flags are then unused")


def _spec_from_values(values: dict) -> AttentionSpec:
    """A spec from field values (None or False: the default), TileConfig's fields included."""
    knobs = {f.name for f in dataclasses.fields(TileConfig) if f.metadata.get("cli", True)}
    given = {k: v for k, v in values.items() if v is not None and v is not False}
    config = {k: given.pop(k) for k in list(given) if k in knobs}
    if "tile" in config:
        config["tile"] = tuple(config["tile"])
    return AttentionSpec(config=TileConfig(**config), **given)


def _parse_pairs(text: str) -> AttentionSpec:
    """``arch=sm_89,head_dim=128,tile=64x64,kv_splits=2,causal=1``, typed by the spec's fields."""
    fields = {f.name: f for f in _spec_fields()}
    values = {}
    for item in filter(None, text.split(",")):
        name, eq, raw = item.partition("=")
        if not eq:
            raise SpecError(f"{item!r} is not name=value (in {text!r})")
        f = fields.get(name.strip())
        if f is None:
            raise SpecError(f"unknown spec field {name!r}; known: {', '.join(fields)}")
        kind, raw = _field_type(f), raw.strip()
        try:
            if kind == "tile":
                m, n = raw.lower().split("x")
                values[f.name] = (int(m), int(n))
            elif kind == "int":
                values[f.name] = int(raw)
            elif kind == "bool":
                if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                values[f.name] = raw.lower() in ("1", "true", "yes")
            else:
                values[f.name] = raw
        except ValueError:
            want = {"tile": "MxN, e.g. 64x64", "int": "a whole number", "bool": "0 or 1"}[kind]
            raise SpecError(f"{name}={raw!r}: expected {want}") from None
    return _spec_from_values(values)


def _console():
    from rich.console import Console

    return Console()


# -- verbs -------------------------------------------------------------------------------------
def cmd_compile(a: argparse.Namespace) -> int:
    from .compiler.compiler import compile_kernel

    spec = _spec_from(a)
    art = compile_kernel(spec)
    r = art.resources
    print(f"{spec.name}: {r.registers} registers, {art.smem_dynamic} B shared, "
          f"{r.stack_frame_bytes} B stack, entry {art.entry}")
    return 0


def _resource_rows(report: dict) -> list[tuple[str, str]]:
    occ = report["occupancy"]
    spills = report.get("spill_store_bytes")
    rows = [
        ("registers / thread", str(report["registers"])),
        ("threads / block", str(report["threads_per_block"])),
        ("shared memory (dynamic)", f"{report['smem_dynamic_bytes']} B"),
        ("shared memory (static)", f"{report['smem_static_bytes']} B"),
        ("stack frame", f"{report['stack_frame_bytes']} B"),
        ("spills (store / load)",
         "n/a (no ptxas)" if spills is None else f"{spills} B / {report['spill_load_bytes']} B"),
        ("occupancy", (f"{occ['ctas_per_sm']} CTAs/SM, {occ['warps_per_sm']} warps/SM "
                       f"(limited by {occ['limited_by']})")),
    ]
    ptx_h = report["instructions_ptx"]
    sass_h = report.get("instructions_sass")
    for k in ptx_h:
        rows.append((f"{k} (PTX / SASS)", f"{ptx_h[k]} / {sass_h[k] if sass_h else '-'}"))
    return rows


def _print_report(report: dict, out: Path | None) -> None:
    from rich.table import Table

    t = Table(title=f"{report['kernel']} ({report['arch']})", show_header=False)
    for k, v in _resource_rows(report):
        t.add_row(k, v)
    c = _console()
    c.print(t)
    if report.get("sass") is None:
        c.print("SASS: nvdisasm is not installed (pip install nvidia-cuda-nvdisasm); "
                "the SASS columns are empty.")
    if out is not None:
        c.print(f"wrote {out}/: kernel.mlir kernel.ptx kernel.cubin"
                f"{' kernel.sass' if report.get('sass') else ''} spec.json resources.json")


def _report_source(x: str) -> dict | AttentionSpec:
    """A dump folder's report, or spec flags as 'arch=sm_89,head_dim=128,...' (to compile)."""
    from .compiler.safe_read import JSON_MAX, read_regular

    p = Path(x)
    if p.is_dir():
        path = p / "resources.json"
        try:
            report = json.loads(read_regular(path, JSON_MAX).decode())
        except FileNotFoundError:
            raise CliError(f"--compare: {p} is not a dump folder (no resources.json)") from None
        except OSError as e:
            raise CliError(f"--compare: {path} is unreadable: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON
            raise CliError(f"--compare: {path} is unreadable: {e}") from None
        problem = _report_problem(report)
        if problem:
            raise CliError(f"--compare: {path} is not a flashcore dump report ({problem})")
        return report
    if "=" not in x:
        raise CliError(
            f"--compare: {x!r} is neither a dump folder (no such folder) nor name=value pairs"
        )
    return _parse_pairs(x)


_REPORT_NUMBERS = ("registers", "stack_frame_bytes", "spill_store_bytes", "spill_load_bytes",
                   "smem_dynamic_bytes", "smem_static_bytes", "threads_per_block")


def _report_problem(report) -> str | None:
    """What keeps ``report`` (a parsed resources.json) from being compared, or None."""
    if not isinstance(report, dict):
        return f"a {type(report).__name__}, not an object"
    if not isinstance(report.get("kernel"), str):
        return "no 'kernel' name"
    occ = report.get("occupancy")
    if not isinstance(occ, dict) or not _is_int(occ.get("ctas_per_sm")):
        return "no 'occupancy.ctas_per_sm'"
    for k in _REPORT_NUMBERS:
        if k in report and report[k] is not None and not _is_int(report[k]):
            return f"{k!r} is not a number"
    for src in ("instructions_ptx", "instructions_sass"):
        h = report.get(src)
        if h is not None and not (isinstance(h, dict) and all(_is_int(v) for v in h.values())):
            return f"{src!r} is not a table of counts"
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_report(source: dict | AttentionSpec) -> dict:
    if isinstance(source, dict):
        return source
    from .compiler.compiler import compile_kernel
    from .compiler.inspect import resources_report, sass

    art = compile_kernel(source)
    return resources_report(art, sass(art.cubin))


def _check_out_dir(out: Path) -> None:
    """Fail before compiling when ``out`` cannot hold the dump (not a folder, not writable)."""
    import tempfile

    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise CliError(f"--out {out}: cannot write there ({e.strerror or e})") from None


def cmd_dump(a: argparse.Namespace) -> int:
    from .compiler.compiler import compile_kernel, compile_many
    from .compiler.inspect import dump

    if a.compare:
        sources = [_report_source(x) for x in a.compare]  # both checked before compiling
        return _compare(_load_report(sources[0]), _load_report(sources[1]))
    parent = Path(a.out) if a.out else Path("dump")
    specs = None
    if a.all:
        from .compiler.catalog import catalog_specs

        specs = catalog_specs((a.arch,)) if a.arch_given else catalog_specs()
    else:
        spec = _spec_from(a)
    _check_out_dir(parent)
    arts = compile_many(specs) if specs is not None else [compile_kernel(spec)]
    for art in arts:
        out = parent / art.spec.name
        report = dump(art, out)
        _print_report(report, out)
    return 0


def _compare(ra: dict, rb: dict) -> int:
    from rich.table import Table

    t = Table(title=f"{ra['kernel']}  vs  {rb['kernel']}")
    t.add_column("")
    t.add_column("A", justify="right")
    t.add_column("B", justify="right")
    t.add_column("change", justify="right")
    rows = [(k, ra.get(k), rb.get(k)) for k in _REPORT_NUMBERS]
    rows.append(("ctas_per_sm", ra["occupancy"]["ctas_per_sm"], rb["occupancy"]["ctas_per_sm"]))
    for src in ("instructions_ptx", "instructions_sass"):
        if ra.get(src) is not None and rb.get(src) is not None:  # reports of other versions
            keys = list(ra[src]) + [k for k in rb[src] if k not in ra[src]]
            rows += [(f"{k} ({src[13:]})", ra[src].get(k), rb[src].get(k)) for k in keys]
    for k, x, y in rows:
        change = "" if x == y else (f"{y - x:+d}" if isinstance(x, int) and isinstance(y, int) else "*")
        t.add_row(k, str(x), str(y), change)
    _console().print(t)
    return 0


def cmd_precompile(a: argparse.Namespace) -> int:
    from .compiler.catalog import catalog_specs

    specs = []
    for arch in a.arch:
        specs += catalog_specs((arch,))[: a.limit]
    if not a.out:
        arts = _compile_with_progress(specs, a.jobs, None)
        print(f"{len(arts)} kernels in the cache")
        return 0
    from .compiler.catalog_folder import build_catalog_folder, check_target
    from .errors import CatalogError

    out = Path(a.out)
    try:
        check_target(out)  # before compiling anything
    except CatalogError as e:
        raise CliError(f"--out {e}") from None
    built = build_catalog_folder(
        specs, out.resolve(), lambda specs, cache: _compile_with_progress(specs, a.jobs, cache),
        no_ir=a.no_ir)
    if built.not_reused:
        print(f"note: the kernels of the catalog that was in {a.out} were compiled again: "
              f"{built.not_reused}", file=sys.stderr)
    digest = built.sha256
    print(f"catalog of {built.kernels} kernels for {', '.join(a.arch)} in {a.out} (index.json)")
    print(f"index.json sha256 {digest}: pin it with FLASHCORE_CATALOG_SHA256={digest} or "
          "flashcore.load_catalog(path, sha256=...)")
    return 0


def _compile_with_progress(specs, jobs, cache):
    from rich.progress import Progress

    from .compiler.compiler import compile_many

    with Progress(transient=False) as progress:
        task = progress.add_task("compiling", total=len(specs))
        return compile_many(specs, jobs=jobs, cache=cache,
                            progress=lambda s: progress.advance(task))


def cmd_cache(a: argparse.Namespace) -> int:
    from .compiler.cache import MAX_SIZE_ENV, KernelCache, cache_root, parse_size

    cache = KernelCache(cache_root())
    if a.action == "list":
        for path, spec in cache.entries():
            print(f"{spec.name if spec else '?':50s} {path}")
        print(f"{cache.root}: {cache.size_bytes() / 1e6:.1f} MB")
        return 0
    if a.action == "verify":
        problems = cache.verify()
        for path, why in problems:
            print(f"BAD {path}: {why}")
        n = len(cache.entries())
        print(f"{n} entries checked, {len(problems)} bad")
        return 1 if problems else 0
    if a.action == "clear":
        if _report_removal("clear", cache.root, cache.clear(force=a.force)):
            return 1
        print(f"cleared {cache.root}")
        return 0
    if a.action == "prune":
        limit = a.max_size
        if limit is None and os.environ.get(MAX_SIZE_ENV):
            try:
                limit = parse_size(os.environ[MAX_SIZE_ENV])
            except ValueError as e:
                raise CliError(f"{MAX_SIZE_ENV}: {e}") from None
        r = cache.prune(limit)
        failed = _report_removal("prune", cache.root, r.failed)
        print(f"pruned {cache.root}: removed {len(r.removed)} items, freed "
              f"{r.freed_bytes / 1e6:.1f} MB, now {r.size_bytes / 1e6:.1f} MB")
        return failed
    return 2


def _report_removal(verb: str, root: Path, failed: list) -> int:
    for path, why in failed:
        print(f"could not remove {path}: {why}", file=sys.stderr)
    if failed:
        print(f"flashcore cache {verb}: {len(failed)} paths in {root} could not be removed",
              file=sys.stderr)
        return 1
    return 0


def cmd_catalog_hash(a: argparse.Namespace) -> int:
    from .compiler.catalog import INDEX, catalog_sha256

    root = Path(a.dir)
    print(f"{catalog_sha256(root)}  {root / INDEX}")
    return 0


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_info(a: argparse.Namespace) -> int:
    import platform

    from .compiler.cache import KernelCache, cache_root
    from .compiler.fingerprint import dsl_fingerprint, dsl_version, source_hash

    cache = KernelCache(cache_root())
    info = {
        "flashcore": __version__,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "cuda-python": _version("cuda-python"),
        "cuda-bindings": _version("cuda-bindings"),
        "nvidia-cutlass-dsl": dsl_version(),
        "dsl_fingerprint": dsl_fingerprint(),
        "can_compile": dsl_fingerprint() is not None,
        "kernel_source_hash": source_hash(),
        "cache": str(cache.root),
        "cache_entries": len(cache.entries()),
        "cache_mb": round(cache.size_bytes() / 1e6, 2),
        "gpus": [],
    }
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                info["gpus"].append(f"cuda:{i} {p.name} sm_{p.major}{p.minor}")
    except ImportError:
        pass
    for k, v in info.items():
        print(f"{k:20s} {v}")
    return 0


def _size_arg(text: str) -> int:
    from .compiler.cache import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashcore", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"flashcore {__version__}")
    sub = ap.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("compile", help="compile one spec into the cache")
    _add_spec_flags(p)
    _add_spec_json(p)
    p.set_defaults(fn=cmd_compile)

    p = sub.add_parser("dump", help="compile and write IR, PTX, cubin, SASS and resources")
    _add_spec_flags(p)
    _add_spec_json(p)
    p.add_argument("--out", default=None, help="parent folder (default ./dump)")
    p.add_argument("--all", action="store_true", help="every spec of the catalog")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"),
                   help="two dump folders, or two specs as arch=sm_89,head_dim=64,tile=64x64")
    p.set_defaults(fn=cmd_dump)

    p = sub.add_parser("precompile", help="build the catalog in parallel worker processes")
    p.add_argument("--arch", nargs="+", default=["sm_89"], choices=ARCHS,
                   help="the archs to build for (default sm_89)")
    p.add_argument("--jobs", type=_positive_int, default=None,
                   help="parallel compile workers, at least 1 (default: one per CPU core)")
    p.add_argument("--out", default=None,
                   help="write a self-contained catalog folder (built beside it, then swapped "
                        "in; an existing valid catalog there is replaced, any other non-empty "
                        "folder refused and left as it is)")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="only the first N specs of each arch (N >= 1)")
    p.add_argument("--no-ir", action="store_true", help="leave the IR out of the --out catalog")
    p.set_defaults(fn=cmd_precompile)

    p = sub.add_parser("cache", help="list, verify, prune or clear the kernel cache")
    p.add_argument("action", choices=["list", "verify", "prune", "clear"],
                   help="list: the entries and the size; verify: check every entry's checksums "
                        "(exit 1 if any is bad); prune: remove abandoned temporaries and the "
                        "quarantine, and with --max-size the least recently used entries; "
                        "clear: remove everything the cache wrote")
    p.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE",
                   help="prune: evict least recently used entries until the cache is at most "
                        "SIZE, e.g. 500M or 2G (default: $FLASHCORE_CACHE_MAX_SIZE, if set)")
    p.add_argument("--force", action="store_true",
                   help="clear: clear a catalog folder too, removing its index.json")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("catalog-hash",
                       help="verify a catalog and print the sha256 of its index.json (to pin it)")
    p.add_argument("dir", metavar="DIR", help="the catalog folder")
    p.set_defaults(fn=cmd_catalog_hash)

    p = sub.add_parser("info", help="versions, cache, GPUs, whether this host can compile")
    p.set_defaults(fn=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    a.arch_given = "--arch" in argv
    try:
        return a.fn(a)
    except (FlashcoreError, OSError) as e:
        print(f"flashcore {a.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
