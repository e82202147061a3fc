#!/usr/bin/env bash
# Separate hosts on this one machine, by hand or for bench/: network
# namespaces TAG-h0 .. TAG-h(N-1), each with eth0 = 198.18.0.(i+1)/24 on a
# test switch (a bridge in namespace TAG-sw). 198.18.0.0/15 is the range set
# aside for benchmark networks; no namespace has a route anywhere else.
# The same layout and faults as tests/netns_hosts.hpp. Needs root.
#
#   hosts.sh up TAG N          make N hosts
#   hosts.sh down TAG          remove them (kill what runs in them first)
#   hosts.sh cap TAG H RATE    cap both directions of host H's link (tbf: 100mbit, 1gbit, 10gbit)
#   hosts.sh uncap TAG H
#   hosts.sh cut TAG H         host H's switch port passes nothing (the link keeps its carrier)
#   hosts.sh heal TAG H        undo cut (back to the cap, if any)
#   hosts.sh run TAG H CMD...  run CMD on host H (ip netns exec)
#
# Example: two nodes started by hand on two "hosts" linked at 100 Mbit/s:
#   sudo scripts/netns/hosts.sh up dt 3
#   sudo scripts/netns/hosts.sh cap dt 1 100mbit; sudo scripts/netns/hosts.sh cap dt 2 100mbit
#   sudo scripts/netns/hosts.sh run dt 0 ./build/dtactor --role coordinator --listen tcp://198.18.0.1:29400 --set cluster.min_nodes=2 &
#   sudo scripts/netns/hosts.sh run dt 1 ./build/dtactor --role node --coordinator tcp://198.18.0.1:29400 &
#   sudo scripts/netns/hosts.sh run dt 2 ./build/dtactor --role node --coordinator tcp://198.18.0.1:29400
set -euo pipefail
cmd=${1:-}
tag=${2:-}
[ -n "$cmd" ] && [ -n "$tag" ] || { echo "usage: hosts.sh up|down|cap|uncap|cut|heal|run TAG ..." >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "hosts.sh: needs root (network namespaces)" >&2; exit 1; }
sw=$tag-sw
ns() { echo "$tag-h$1"; }
port() { echo "$tag-p$1"; }
drop="root tbf rate 8bit burst 1 limit 1"
capfile() { echo "/run/dtactor-hosts-$tag-cap$1"; }

case $cmd in
  up)
    n=${3:?hosts.sh up TAG N}
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for ((h = 0; h < n; h++)); do
      ip netns add "$(ns $h)"
      ip link add "$tag-a$h" type veth peer name "$(port $h)"
      ip link set "$tag-a$h" netns "$(ns $h)"
      ip link set "$(port $h)" netns "$sw"
      ip -n "$(ns $h)" link set "$tag-a$h" name eth0
      ip -n "$(ns $h)" addr add "198.18.0.$((h + 1))/24" dev eth0
      ip -n "$(ns $h)" link set eth0 up
      ip -n "$(ns $h)" link set lo up
      ip -n "$sw" link set "$(port $h)" master br0
      ip -n "$sw" link set "$(port $h)" up
    done
    ;;
  down)
    for n in $(ip netns list | awk '{print $1}' | grep -E "^$tag-(h[0-9]+|sw)$"); do
      for pid in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$n"
    done
    rm -f /run/dtactor-hosts-"$tag"-cap*
    ;;
  cap)
    h=${3:?}; rate=${4:?}
    ip netns exec "$(ns $h)" tc qdisc replace dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
    ip netns exec "$sw" tc qdisc replace dev "$(port $h)" root tbf rate "$rate" burst 256kb latency 50ms
    echo "$rate" >"$(capfile $h)"
    ;;
  uncap)
    h=${3:?}
    ip netns exec "$(ns $h)" tc qdisc del dev eth0 root 2>/dev/null || true
    ip netns exec "$sw" tc qdisc del dev "$(port $h)" root 2>/dev/null || true
    rm -f "$(capfile $h)"
    ;;
  cut)
    h=${3:?}
    ip netns exec "$sw" tc qdisc replace dev "$(port $h)" $drop
    ip netns exec "$(ns $h)" tc qdisc replace dev eth0 $drop
    ;;
  heal)
    h=${3:?}
    if [ -f "$(capfile $h)" ]; then
      "$0" cap "$tag" "$h" "$(cat "$(capfile $h)")"
    else
      ip netns exec "$sw" tc qdisc del dev "$(port $h)" root
      ip netns exec "$(ns $h)" tc qdisc del dev eth0 root
    fi
    ;;
  run)
    h=${3:?}; shift 3
    exec ip netns exec "$(ns $h)" "$@"
    ;;
  *)
    echo "hosts.sh: unknown command '$cmd'" >&2; exit 2
    ;;
esac
