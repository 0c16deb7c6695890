"""Write the image's SBOM from inside the image, at build time: CycloneDX 1.5 JSON.

    /usr/bin/python3 -I sbom.py SBOM_INPUT_JSON VENV OUT

Lists every installed Debian package (dpkg's status: name, version, architecture, source; licenses
from machine-readable /usr/share/doc/<pkg>/copyright files) and every Python distribution in the
venv (its metadata: name, version, license; the sha256 of the wheel it was installed from, from
the cell's lock, which `build.py build` stages as SBOM_INPUT_JSON with the cell's facts), each with
its purl, and the image's own facts (torch, CUDA, cuDNN, NCCL, Python: what its labels say) as
properties of the image component. Deterministic (no timestamp, a serial number derived from the
content): two builds from one lock give the same bytes.

Runs under the image's system Python (3.8 or newer), standard library only, as root (writes OUT,
0644). A distribution in the venv that the lock does not name gets no hash and the property
ptmg:in-lock=false (the build's installs come from the lock only, so none is expected).
"""

import email.parser
import glob
import hashlib
import json
import os
import re
import sys
import uuid
from urllib.parse import quote

SPEC = "1.5"
DPKG_STATUS = "/var/lib/dpkg/status"
NS = "io.pt-multi-gpu"


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def enc(text):
    return quote(text, safe=".-_~")


def os_release():
    info = {}
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep:
                    info[key] = value.strip('"')
    except OSError:
        pass
    return info.get("ID", "debian"), info.get("VERSION_ID", "")


def dpkg_packages():
    with open(DPKG_STATUS, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for para in text.split("\n\n"):
        fields = {}
        key = None
        for line in para.splitlines():
            if line[:1] in (" ", "\t") and key:
                continue  # continuation lines (descriptions, conffiles): not needed
            key, sep, value = line.partition(":")
            if sep:
                fields[key] = value.strip()
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            yield fields


def deb_licenses(package):
    """License names of a DEP-5 (machine-readable) copyright file; [] when it is free-form."""
    path = f"/usr/share/doc/{package}/copyright"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(200000)
    except OSError:
        return []
    if "copyright-format" not in text.split("\n\n", 1)[0]:
        return []
    names = []
    for line in text.splitlines():
        if line.startswith("License:"):
            name = line[len("License:"):].strip()
            if name and name not in names and len(name) <= 80:
                names.append(name)
    return names[:10]


def py_licenses(meta):
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return [{"expression": expression}]
    names = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    names = [n for n in names if n and n != "OSI Approved"]
    text = (meta.get("License") or "").strip()
    if not names and text and "\n" not in text and len(text) <= 80 and text.upper() != "UNKNOWN":
        names = [text]
    return [{"license": {"name": n}} for n in dict.fromkeys(names)]


def venv_dists(venv):
    parser = email.parser.HeaderParser()
    for info in sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "*.dist-info"))):
        try:
            with open(os.path.join(info, "METADATA"), encoding="utf-8", errors="replace") as f:
                meta = parser.parse(f)
        except OSError:
            continue
        if meta.get("Name") and meta.get("Version"):
            yield meta


def prop(name, value):
    return {"name": name, "value": str(value)}


def main(argv):
    sbom_input, venv, out = argv[1:4]
    with open(sbom_input, encoding="utf-8") as f:
        given = json.load(f)
    locked = given.get("packages", {})
    facts = given.get("facts", {})
    distro, version_id = os_release()
    components = []
    for fields in dpkg_packages():
        name, version, arch = fields["Package"], fields.get("Version", ""), fields.get("Architecture", "")
        purl = f"pkg:deb/{distro}/{enc(name)}@{enc(version)}?arch={enc(arch)}"
        if version_id:
            purl += f"&distro={distro}-{version_id}"
        c = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
             "properties": [prop("ptmg:source", "dpkg")]}
        source = fields.get("Source", "").split(" ")[0]
        if source and source != name:
            c["properties"].append(prop("ptmg:deb:source", source))
        lic = deb_licenses(name)
        if lic:
            c["licenses"] = [{"license": {"name": n}} for n in lic]
        components.append(c)
    for meta in venv_dists(venv):
        name, version = canonical(meta["Name"]), meta["Version"]
        purl = f"pkg:pypi/{enc(name)}@{enc(version)}"
        c = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
             "properties": [prop("ptmg:source", "venv")]}
        entry = locked.get(name)
        if entry and entry.get("version") == version:
            c["hashes"] = [{"alg": "SHA-256", "content": entry["sha256"]}]
            c["externalReferences"] = [{"type": "distribution", "url": entry["url"]}]
            c["properties"] += [prop("ptmg:wheel", entry["filename"]), prop("ptmg:layer", entry["layer"]),
                                prop("ptmg:in-lock", "true")]
        else:
            c["properties"].append(prop("ptmg:in-lock", "false"))
        lic = py_licenses(meta)
        if lic:
            c["licenses"] = lic
        components.append(c)
    components.sort(key=lambda c: c["bom-ref"])
    image = {"type": "container", "bom-ref": "image", "name": facts.get("repository", "pt-multi-gpu"),
             "version": facts.get("tag", given.get("cell", "")),
             "properties": [prop(f"{NS}.{k}", v) for k, v in sorted(facts.items()) if v != ""]}
    lock = given.get("lock", {})
    image["properties"] += [prop(f"{NS}.lock", lock.get("file", "")),
                            prop(f"{NS}.lock.digest", lock.get("digest", ""))]
    body = json.dumps(components, sort_keys=True)
    content = hashlib.sha256((json.dumps(image, sort_keys=True) + body).encode()).hexdigest()
    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC,
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'ptmg-sbom:' + content)}",
        "version": 1,
        "metadata": {
            "tools": {"components": [{"type": "application", "name": "pt-multi-gpu imagebuild/sbom.py"}]},
            "component": image,
        },
        "components": components,
    }
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(bom, f, indent=1, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    n_deb = sum(1 for c in components if c["purl"].startswith("pkg:deb/"))
    unlocked = [c["name"] for c in components if {"name": "ptmg:in-lock", "value": "false"} in c["properties"]]
    note = f" (not in the lock: {', '.join(unlocked)})" if unlocked else ""
    print(f"SBOM {out}: {n_deb} Debian packages, {len(components) - n_deb} Python distributions{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
