"""How the machines of a launch meet: the rendezvous store hasten hosts on one address (``store``), the
network check before the first collective (``check``), the UDP reports between launchers (``reports``),
the MIN:MAX watch of machines leaving and joining (``watch``) and the elastic membership rendezvous
backend (``membership``). Which address is whose is detection, in :mod:`hasten.environments.network`.
"""
