# Owner(s): ["module: inductor"]
"""The upstream contracts of collective_contracts.py: each holds on this torch, and each
fails once its assumption is broken as a change upstream would break it."""

from __future__ import annotations

import re
import unittest

from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from collective_contracts import ContractBroken, CONTRACTS, not_checkable
from collective_harness import under_torchrun


def case_name(contract) -> str:
    """The contract's name as a test name: words only (unittest splits names on ".")."""
    return re.sub(r"\W+", "_", contract.name).strip("_")


@unittest.skipIf(under_torchrun(), "one process's own torch: runs self-spawned only")
class TestUpstreamContracts(TestCase):
    @parametrize("contract", CONTRACTS, name_fn=case_name)
    def test_the_contract_holds(self, contract):
        if why := not_checkable(contract):
            self.skipTest(why)
        contract.verify()

    @parametrize("contract", CONTRACTS, name_fn=case_name)
    def test_the_contract_fails_once_upstream_breaks_it(self, contract):
        if why := not_checkable(contract):
            self.skipTest(why)
        with (
            contract.breaks(),
            self.assertRaisesRegex(ContractBroken, re.escape(contract.name)),
        ):
            contract.verify()


instantiate_parametrized_tests(TestUpstreamContracts)


if __name__ == "__main__":
    run_tests()
