"""The upstream contracts of collective_contracts.py: each holds on this torch, and each
fails once its assumption is broken as a change upstream would break it."""

from __future__ import annotations

import re

import pytest

from collective_contracts import ContractBroken, CONTRACTS, not_checkable
from collective_harness import under_torchrun


pytestmark = pytest.mark.skipif(under_torchrun(), reason="one process's own torch: runs self-spawned only")


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.name for c in CONTRACTS])
def test_the_contract_holds(contract):
    if why := not_checkable(contract):
        pytest.skip(why)
    contract.verify()


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c.name for c in CONTRACTS])
def test_the_contract_fails_once_upstream_breaks_it(contract):
    if why := not_checkable(contract):
        pytest.skip(why)
    with contract.breaks(), pytest.raises(ContractBroken, match=re.escape(contract.name)):
        contract.verify()
