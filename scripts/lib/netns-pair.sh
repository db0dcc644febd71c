# Sourced by the two-host scripts: two network namespaces joined by a veth pair, the simulated
# "hosts" of lockstep's multi-host tests. Needs root.
#
# netns_pair NS_A NS_B VETH_A VETH_B PREFIX: creates NS_A (PREFIX.1) and NS_B (PREFIX.2), e.g.
# PREFIX=10.77.0, with loopback and the veth ends up. netns_unpair NS_A NS_B deletes them (and so
# the veth pair).

netns_pair() {
    local a="$1" b="$2" va="$3" vb="$4" prefix="$5"
    ip netns add "$a"
    ip netns add "$b"
    ip link add "$va" type veth peer name "$vb"
    ip link set "$va" netns "$a"
    ip link set "$vb" netns "$b"
    ip -n "$a" addr add "$prefix.1/24" dev "$va"
    ip -n "$b" addr add "$prefix.2/24" dev "$vb"
    for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set "$va" up
    ip -n "$b" link set "$vb" up
}

netns_unpair() {
    ip netns del "$1" 2>/dev/null || true
    ip netns del "$2" 2>/dev/null || true
}
