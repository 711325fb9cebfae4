"""`mesh authority new`, `mesh grant`, `mesh revoke`, `mesh grants` and the --identity and
--grant options, as subprocesses against a mesh that requires grants."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from helpers import MESH, run_mesh

import irismesh


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_mesh(args, env)


def ok(env: dict[str, str], *args: str) -> str:
    result = run(env, *args)
    assert result.returncode == 0, f"mesh {' '.join(args)}: {result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def test_grants_from_the_command_line(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"), COLUMNS="200")
    env.pop("IRISMESH_KEYS", None)
    env.pop("IRISMESH_KEYFILE", None)
    made = json.loads(ok(env, "authority", "new", "--json"))
    authority_file = Path(made["path"])
    assert stat.S_IMODE(authority_file.stat().st_mode) == 0o600
    keyfile = tmp_path / "mesh.keys"
    keys = irismesh.Keyring.generate(["*"])
    text = keys.to_text() + f"@authority {made['public']}\n@require-grants\n"
    keyfile.write_text(text)
    keyfile.chmod(0o600)
    env["IRISMESH_KEYFILE"] = str(keyfile)

    def identity(name: str, *rights: str) -> list[str]:
        path = tmp_path / f"{name}.identity"
        public = json.loads(ok(env, "identity", "new", str(path), "--json"))["public"]
        grant = tmp_path / f"{name}.grant"
        ok(env, "grant", *rights, "--expires", "1h", "--out", str(grant), public)
        return ["--identity", str(path), "--grant", str(grant)]

    member = identity("member", "--serve", "db")
    caller = identity("caller", "--call", "db")
    proc = subprocess.Popen(
        [*MESH, "node", "--cluster", "db", "--bind", "tcp://127.0.0.1:0", "--json", *member],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        seed = json.loads(proc.stdout.readline())["endpoint"]
        joining = ["--seed", seed, "--no-discovery", "--wait", "10"]
        assert ok(env, "request", "db", "hi", *joining, *caller).strip() == "hi"
        refused = run(env, "request", "payroll", "hi", *joining, *caller)
        assert refused.returncode == 1
        assert "no right to call 'payroll'" in refused.stderr
        listed = json.loads(ok(env, "grants", "--json", *joining, *caller))
        assert [entry["rights"] for entry in listed] == [{"serve": ["db"]}]
        peers = json.loads(ok(env, "peers", "--json", *joining, *caller))
        member_public = Path(tmp_path / "member.identity")
        assert peers[0]["public"] == irismesh.Identity.load(member_public).public.hex()
        caller_public = irismesh.Identity.load(tmp_path / "caller.identity").public.hex()
        revoked = json.loads(ok(env, "revoke", caller_public, "--json", *joining))
        assert revoked["node"] == caller_public
        after = run(env, "request", "db", "hi", *joining, "--timeout", "2", *caller)
        assert after.returncode == 1, after.stdout
    finally:
        proc.kill()
        proc.communicate(timeout=10)
