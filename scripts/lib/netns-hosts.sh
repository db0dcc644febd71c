# Sourced by the three-host scripts: N network namespaces (the simulated "hosts") on one bridge,
# which lives in a namespace of its own so that nothing of the machine's own network changes.
# Needs root.
#
# netns_hosts TAG PREFIX NS...: creates a bridge namespace "${TAG}br" and each NS with address
# PREFIX.1, PREFIX.2, … on a veth whose other end ("${TAG}p1", "${TAG}p2", … in the bridge
# namespace) is a bridge port. netns_cut TAG I / netns_mend TAG I take host I's port down / up
# (its link is cut; the host itself keeps running). netns_unhosts TAG NS... deletes them all.

netns_hosts() {
    local tag="$1" prefix="$2"; shift 2
    local br="${tag}br" i=1
    ip netns add "$br"
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    ip -n "$br" link set lo up
    for ns in "$@"; do
        ip netns add "$ns"
        ip link add "${tag}h$i" type veth peer name "${tag}p$i"
        ip link set "${tag}h$i" netns "$ns"
        ip link set "${tag}p$i" netns "$br"
        ip -n "$br" link set "${tag}p$i" master br0
        ip -n "$br" link set "${tag}p$i" up
        ip -n "$ns" addr add "$prefix.$i/24" dev "${tag}h$i"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "${tag}h$i" up
        i=$((i + 1))
    done
}

netns_cut() { ip -n "${1}br" link set "${1}p$2" down; }
netns_mend() { ip -n "${1}br" link set "${1}p$2" up; }

netns_unhosts() {
    local tag="$1"; shift
    for ns in "$@" "${tag}br"; do ip netns del "$ns" 2>/dev/null || true; done
}
