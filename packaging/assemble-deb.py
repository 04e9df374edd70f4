#!/usr/bin/env python3
"""Assembles the Debian package of felhom-agent with dpkg-deb, from `[package.metadata.deb]`
in agent/Cargo.toml (read through `cargo metadata`). packaging/build-deb.sh runs it after the
binary and the docs are built; see packaging/README.md.

    assemble-deb.py --metadata FILE --target DIR --out DIR [--fast]

FILE is the output of `cargo metadata --format-version 1 --no-deps`. Asset sources are relative
to agent/; a source under `target/release/` is taken from DIR/release/ (DIR: the target
folder of the build). Writes DEBIAN/control (Depends `$auto` from dpkg-shlibdeps), conffiles
(every file under /etc), md5sums and the maintainer scripts, the changelog as
changelog.Debian.gz, strips the binary, and prints the path of the .deb it wrote.
"""

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

PACKAGE = "felhom-agent"


def fail(msg):
    print(f"assemble-deb.py: {msg}", file=sys.stderr)
    sys.exit(1)


def gzip_n(src, dst):
    """gzip -9n: no name, no time stamp (reproducible bytes)."""
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as out:
        with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz:
            gz.write(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fast", action="store_true")
    args = ap.parse_args()

    with open(args.metadata, encoding="utf-8") as f:
        meta = json.load(f)
    pkg = next((p for p in meta["packages"] if p["name"] == PACKAGE), None)
    if pkg is None:
        fail(f"no package {PACKAGE} in the cargo metadata")
    deb = (pkg.get("metadata") or {}).get("deb")
    if not deb:
        fail("agent/Cargo.toml has no [package.metadata.deb]")
    crate_dir = os.path.dirname(pkg["manifest_path"])
    version = f"{pkg['version']}-{deb.get('revision', '1')}"
    arch = subprocess.run(
        ["dpkg", "--print-architecture"], check=True, capture_output=True, text=True
    ).stdout.strip()

    work = tempfile.mkdtemp(prefix="felhom-deb.")
    try:
        root = os.path.join(work, "root")
        control_dir = os.path.join(root, "DEBIAN")
        os.makedirs(control_dir)
        os.chmod(root, 0o755)
        files = []
        for src, dest, mode in deb["assets"]:
            if src.startswith("target/release/"):
                src_path = os.path.join(args.target, "release", src[len("target/release/"):])
            else:
                src_path = os.path.normpath(os.path.join(crate_dir, src))
            if not os.path.isfile(src_path):
                fail(f"asset {src} is missing ({src_path})")
            rel = dest.lstrip("/")
            if rel.endswith("/"):
                rel += os.path.basename(src_path)
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            shutil.copyfile(src_path, path)
            os.chmod(path, int(mode, 8))
            files.append(rel)
        # The Debian changelog, compressed as policy wants.
        if deb.get("changelog"):
            rel = f"usr/share/doc/{PACKAGE}/changelog.Debian.gz"
            gzip_n(os.path.normpath(os.path.join(crate_dir, deb["changelog"])), os.path.join(root, rel))
            os.chmod(os.path.join(root, rel), 0o644)
            files.append(rel)
        # Every folder 0755, whatever the umask.
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)

        # The binaries: stripped (lintian: unstripped-binary-or-object), their libraries for
        # Depends from dpkg-shlibdeps.
        bins = [r for r in files if r.startswith("usr/bin/")]
        for rel in bins:
            subprocess.run(
                ["strip", "--strip-unneeded", "--remove-section=.comment",
                 "--remove-section=.note", os.path.join(root, rel)],
                check=True,
            )
        depends = deb.get("depends", "$auto")
        if "$auto" in depends:
            # dpkg-shlibdeps wants a debian/control beside it; an empty one will do.
            os.makedirs(os.path.join(work, "debian"))
            open(os.path.join(work, "debian", "control"), "w").close()
            out = subprocess.run(
                ["dpkg-shlibdeps", "-O", "--ignore-missing-info"]
                + [os.path.join(root, r) for r in bins],
                cwd=work, check=True, capture_output=True, text=True,
            ).stdout
            auto = ""
            for line in out.splitlines():
                if line.startswith("shlibs:Depends="):
                    auto = line[len("shlibs:Depends="):].strip()
            if not auto:
                fail(f"dpkg-shlibdeps gave no dependency: {out!r}")
            depends = ", ".join(
                part for part in (p.strip() for p in depends.replace("$auto", auto).split(",")) if part
            )

        installed = 0
        for rel in files:
            installed += (os.path.getsize(os.path.join(root, rel)) + 1023) // 1024
        for dirpath, dirnames, _ in os.walk(root):
            installed += len(dirnames)

        # The synopsis: Debian wants at most 80 characters (lintian: synopsis-too-long), which
        # the crate's description exceeds; `synopsis` in the metadata gives the short line.
        summary = deb.get("synopsis") or pkg.get("description") or PACKAGE
        if len(summary) > 80:
            fail(f"the synopsis is {len(summary)} characters, at most 80: set synopsis in [package.metadata.deb]")
        extended = deb.get("extended-description", "")
        lines = [
            f"Package: {deb.get('name', PACKAGE)}",
            f"Version: {version}",
            f"Architecture: {arch}",
            f"Maintainer: {deb['maintainer']}",
            f"Installed-Size: {installed}",
            f"Depends: {depends}",
        ]
        if deb.get("suggests"):
            lines.append(f"Suggests: {deb['suggests']}")
        lines += [
            f"Section: {deb.get('section', 'admin')}",
            f"Priority: {deb.get('priority', 'optional')}",
        ]
        desc = [f"Description: {summary}"]
        for para in extended.strip().split("\n\n"):
            if len(desc) > 1:
                desc.append(" .")
            desc += [" " + w for w in textwrap.wrap(" ".join(para.split()), 79)]
        lines += desc
        with open(os.path.join(control_dir, "control"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

        conffiles = sorted("/" + r for r in files if r.startswith("etc/"))
        if conffiles:
            with open(os.path.join(control_dir, "conffiles"), "w", encoding="utf-8") as f:
                f.write("\n".join(conffiles) + "\n")
        with open(os.path.join(control_dir, "md5sums"), "w", encoding="utf-8") as f:
            for rel in sorted(files):
                with open(os.path.join(root, rel), "rb") as b:
                    f.write(f"{hashlib.md5(b.read()).hexdigest()}  {rel}\n")
        scripts = deb.get("maintainer-scripts")
        if scripts:
            sdir = os.path.normpath(os.path.join(crate_dir, scripts))
            for name in ("preinst", "postinst", "prerm", "postrm"):
                p = os.path.join(sdir, name)
                if os.path.isfile(p):
                    shutil.copyfile(p, os.path.join(control_dir, name))
                    os.chmod(os.path.join(control_dir, name), 0o755)
        for name in ("control", "conffiles", "md5sums"):
            p = os.path.join(control_dir, name)
            if os.path.exists(p):
                os.chmod(p, 0o644)

        os.makedirs(args.out, exist_ok=True)
        out_deb = os.path.join(args.out, f"{deb.get('name', PACKAGE)}_{version}_{arch}.deb")
        compress = ["-Zgzip", "-z1"] if args.fast else ["-Zxz"]
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", *compress, "--build", root, out_deb],
            check=True, stdout=subprocess.DEVNULL,
        )
        print(out_deb)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
