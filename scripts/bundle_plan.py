"""Which wheels an offline bundle holds: MILI's runtime and test dependencies (pyproject.toml's `dev`
extra, which takes in the worker, the gateway and the demo), each pinned to the version installed in
the environment that runs this script, the one the project's tests run in.

    .venv/bin/python scripts/bundle_plan.py --python 3.12 --machine x86_64 [--all]

Requirements are followed through each installed distribution's own, with environment markers
evaluated for the target (its Python version, Linux, its machine), not for this interpreter. Prints
one line per distribution reached: `bundle NAME VERSION` for a wheel to bring, `host NAME VERSION`
for one the target already has (scripts/gpu_host_packages.txt; with --all only torch and triton),
the version being the one tested here.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the worker extra brings tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
HOST_PACKAGES = ROOT / "scripts" / "gpu_host_packages.txt"
EXTRA = "dev"
# The host's own, always: its torch is the CUDA build matched to its driver, and triton goes with torch.
KEPT_FROM_HOST = {"torch", "triton"}
# Never bundled, and not followed.
LEFT_OUT = {
    # The board's browser tests drive Debian's chromium, which a GPU host lacks; no GPU stage runs them.
    "playwright",
}


class PlanError(Exception):
    pass


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def target_environment(python: str, machine: str) -> dict[str, str]:
    """`python` as 3.12 or 3.12.3 (markers such as redis's `python_full_version < "3.11.3"` need the latter)."""
    release = python.split(".")
    full = ".".join(release + ["0"] * (3 - len(release)))
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": ".".join(release[:2]),
        "sys_platform": "linux",
    }


def applies(marker: Marker | None, env: dict[str, str], extras: set[str], include_base: bool = True) -> bool:
    """Whether a requirement with this marker holds on the target for any of `extras` (and, with
    `include_base`, without an extra)."""
    if marker is None:
        return include_base
    return any(marker.evaluate({**env, "extra": extra}) for extra in extras | ({""} if include_base else set()))


def project_requirements(env: dict[str, str]) -> list[Requirement]:
    """The `dev` extra's requirements, the project's own extras it names expanded in place."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = normalized(project["name"])
    found, pending, seen = [], [EXTRA], set()
    found += [Requirement(r) for r in project["dependencies"]]
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if normalized(requirement.name) == own:
                pending += sorted(requirement.extras)
            elif applies(requirement.marker, env, set()):
                found.append(requirement)
    return found


def installed_version(requirement: Requirement, needed_by: str) -> str:
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        raise PlanError(
            f"{requirement.name} (needed by {needed_by} on the target) is not installed here; install it into "
            f"this environment first, so that the bundle pins a version the tests ran with"
        ) from None
    if not requirement.specifier.contains(version, prereleases=True):
        raise PlanError(f"{needed_by} needs {requirement}, but {version} is installed here")
    return version


def plan(env: dict[str, str], host: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({name: version} to bundle, {name: version} the host provides), over the whole closure."""
    bundle, provided, extras_followed = {}, {}, {}
    pending = [(r, "mili") for r in project_requirements(env)]
    while pending:
        requirement, needed_by = pending.pop()
        name = normalized(requirement.name)
        if name in LEFT_OUT or name in provided:
            continue
        if name not in bundle:
            version = installed_version(requirement, needed_by)
            if name in host:
                provided[name] = version  # the host's dependencies come with it
                continue
            bundle[name] = version
        # A distribution reached again with more extras (redis, then redis[hiredis]) adds their requirements.
        followed = extras_followed.get(name)
        wanted = set(requirement.extras) | {""}
        if followed is not None and wanted <= followed:
            continue
        extras_followed[name] = (followed or set()) | wanted
        for line in metadata.requires(requirement.name) or []:
            dependency = Requirement(line)
            if applies(dependency.marker, env, wanted - (followed or set()), include_base=followed is None):
                pending.append((dependency, name))
    return bundle, provided


def host_packages(everything_bundled: bool) -> set[str]:
    if everything_bundled:
        return set(KEPT_FROM_HOST)
    lines = (line.split("#")[0].strip() for line in HOST_PACKAGES.read_text().splitlines())
    return {normalized(line) for line in lines if line} | KEPT_FROM_HOST


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the target's Python version, as 3.12")
    parser.add_argument("--machine", required=True, help="the target's machine, as x86_64")
    parser.add_argument("--all", action="store_true", help="bundle what the GPU host has too (not torch, triton)")
    args = parser.parse_args()
    try:
        bundle, provided = plan(target_environment(args.python, args.machine), host_packages(args.all))
    except PlanError as e:
        print(f"bundle_plan: {e}", file=sys.stderr)
        return 1
    for kind, found in (("bundle", bundle), ("host", provided)):
        for name, version in sorted(found.items()):
            print(kind, name, version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
