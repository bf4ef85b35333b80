"""Run deploy/argocd/health.lua the way Argo CD does: ``obj`` is the resource, the script returns
``{status, message}``. Lua is the real interpreter (lupa)."""

from __future__ import annotations

from typing import Any

import lupa

from tests.packaging import manifests

SCRIPT = manifests.ROOT / "deploy" / "argocd" / "health.lua"


def health(obj: dict[str, Any]) -> dict[str, str]:
    lua = lupa.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT.read_text())
    return {"status": str(result["status"]), "message": str(result["message"])}
