"""Helpers shared by the accountant and ledger tests (tests/dpcore/accountants/, tests/dpcore/ledger/):
ε of a dp_accounting event by dp_accounting's own PLD and RDP accountants, the independent
reference every ε of ours is checked against."""

import dp_accounting


def _dpa_pld(event, delta):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def _dpa_rdp(event, delta, orders=None):
    acc = dp_accounting.rdp.RdpAccountant(orders=orders) if orders else dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)
