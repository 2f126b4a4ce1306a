"""After scripts/bootstrap.sh --offline: what the environment uses, checked against the bundle's MANIFEST.

    .venv/bin/python scripts/bundle_check.py BUNDLE/MANIFEST

Prints, for each distribution the bundle brought or expected of the host, the version in use and
where it comes from; fails if one is missing or if MILI's packages do not import. A requirement
that an installed version does not meet (the host's typing-extensions older than pydantic wants)
is printed as a warning: the host's own packages are not ours to replace.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Importing these loads every runtime dependency and the test plugins the GPU stages use.
MODULES = (
    "producer_client",
    "worker.__main__",
    "worker.engine",
    "gateway.app",
    "cli.__main__",
    "cli.batch_file",
    "kernels",
    "fakeredis",
    "pytest_asyncio",
    "openai",
    "transformers",
)


def manifest_entries(manifest: Path) -> list[tuple[str, str, str]]:
    """(kind, name, version) of the wheel and host lines."""
    entries = []
    for line in manifest.read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in ("wheel", "host"):
            entries.append((fields[0], fields[1], fields[2]))
    return entries


def origin(name: str) -> str:
    location = Path(str(metadata.distribution(name).locate_file(""))).resolve()
    return "this venv" if location.is_relative_to(Path(sys.prefix).resolve()) else f"host ({location})"


def report_versions(entries: list[tuple[str, str, str]]) -> list[str]:
    """Prints what is in use; returns the names that are missing."""
    missing = []
    print(f"{'package':24s} {'bundled/tested':16s} {'in use':16s} from")
    for _kind, name, version in entries:
        try:
            used = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            print(f"{name:24s} {version:16s} {'MISSING':16s} -")
            continue
        print(f"{name:24s} {version:16s} {used:16s} {origin(name)}")
    return missing


def unmet_requirements(names: list[str]) -> list[str]:
    """Requirements (without extras' ones) of these distributions that the installed versions miss."""
    unmet = []
    for name in names:
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                version = metadata.version(requirement.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{name} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{name} needs {requirement}: {version} is installed")
    return unmet


def failed_imports() -> list[str]:
    failed = []
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:
            failed.append(f"{module}: {type(e).__name__}: {e}")
    return failed


def main() -> int:
    entries = manifest_entries(Path(sys.argv[1]))
    missing = report_versions(entries)
    present = [name for _, name, _ in entries if canonicalize_name(name) not in set(map(canonicalize_name, missing))]
    for problem in unmet_requirements(present):
        print(f"warning: {problem}")
    if missing:
        print(
            f"missing: {', '.join(missing)} (the bundle expects the host to have them; "
            f"scripts/bundle.sh --all bundles them too)"
        )
        return 1
    failed = failed_imports()
    for failure in failed:
        print(f"import failed: {failure}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
