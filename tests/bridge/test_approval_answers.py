"""How a text turn answers each kind of approval request under each policy."""

import pytest

from bridge.process.text_turn import approval_answer

pytestmark = pytest.mark.quick


def test_legacy_and_permission_approvals_get_their_own_answer_shapes():
    assert approval_answer("execCommandApproval", {}, "accept") == {"decision": "approved"}
    assert approval_answer("applyPatchApproval", {}, "cancel") == {"decision": "abort"}
    assert approval_answer("execCommandApproval", {}, "decline")["decision"]["denied"]
    requested = {"permissions": {"network": {"enabled": True}}}
    assert approval_answer("item/permissions/requestApproval", requested, "acceptForSession") == {
        "permissions": {"network": {"enabled": True}},
        "scope": "session",
    }
    assert approval_answer("item/permissions/requestApproval", requested, "decline") == {
        "permissions": {}
    }
    assert approval_answer("item/tool/call", {}, "accept") is None
