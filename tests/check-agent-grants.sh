#!/usr/bin/env bash
# Fails (exit 1, naming each line) when a tmpfiles snippet or a systemd unit given as argument
# gives the agent's user (felhom-agent) write access to a path outside the agent's own folders
# (/var/lib/felhom-agent, /var/lib/felhom-agent-metrics and below; a path with a `..` or `.`
# component is never one of them). Root must never write in a folder that user may write: a
# planted link there would steer root's write.
#
# tmpfiles lines: an ACL (a, a+, A, A+) with an entry holding w for the user, one of its
# groups (felhom-agent, and www-data, which an older version added it to:
# packaging/felhom-agent.sysusers) or others (o::, other::); a
# path made or adjusted (d, D, e, v, q, Q, z, Z, f, f+, F, w, w+, C, C+, x…) owned by
# felhom-agent with the owner's write bit, of one of its groups with the group's write bit, or
# with the others' write bit whoever owns it (world-writable, sticky or not). Units with
# User=felhom-agent: every ReadWritePaths= entry and StateDirectory=/CacheDirectory=/
# LogsDirectory= name. Usage: check-agent-grants.sh FILE...
set -u
user=felhom-agent
# The groups the user is or was in (packaging/felhom-agent.sysusers; www-data by an older
# version).
groups="felhom-agent www-data"
bad=0

in_groups() {
  local g
  for g in $groups; do [ "$1" = "$g" ] && return 0; done
  return 1
}

own() {
  case /$1/ in
    */../* | */./*) return 1 ;;
  esac
  case $1 in
    /var/lib/felhom-agent | /var/lib/felhom-agent/* | /var/lib/felhom-agent-metrics | /var/lib/felhom-agent-metrics/*) return 0 ;;
    *) return 1 ;;
  esac
}

report() {
  printf 'grants %s write access outside its own folders: %s\n' "$user" "$*" >&2
  bad=1
}

check_tmpfiles() {
  local file=$1 type path mode owner group age arg
  while read -r type path mode owner group age arg; do
    case $type in '' | '#'*) continue ;; esac
    case $type in
      a* | A*)
        # ACL entries: [default:]u|user|g|group:NAME:PERMS, comma separated.
        local e
        for e in ${arg//,/ }; do
          e=${e#default:}
          e=${e#d:}
          local who=no
          case $e in
            u:$user:* | user:$user:*) who=yes ;;
            o:* | other:*) who=yes ;;
            g:* | group:*)
              local name=${e#*:}
              in_groups "${name%%:*}" && who=yes
              ;;
          esac
          if [ $who = yes ]; then
            case ${e##*:} in *w*) own "$path" || report "$file: $type $path ... $arg" ;; esac
          fi
        done
        ;;
      L* | r* | R* | t* | T* | h* | H* | p* | c* | b*) ;;
      *)
        # The default mode of a made folder or file gives its owner write access.
        local m=${mode#\~}
        [ "$m" = - ] && m=0755
        local ow=$(((8#$m >> 7) & 1)) gw=$(((8#$m >> 4) & 1)) xw=$(((8#$m >> 1) & 1))
        if { [ "$owner" = "$user" ] && [ "$ow" = 1 ]; } || { in_groups "$group" && [ "$gw" = 1 ]; } ||
          [ "$xw" = 1 ]; then
          own "$path" || report "$file: $type $path $mode $owner $group"
        fi
        ;;
    esac
  done <"$file"
}

check_unit() {
  local file=$1
  grep -qE '^User=felhom-agent[[:space:]]*$' "$file" || return 0
  local line p
  while IFS= read -r line; do
    case $line in
      ReadWritePaths=*)
        for p in ${line#ReadWritePaths=}; do
          p=${p#-}
          p=${p#+}
          own "$p" || report "$file: $line"
        done
        ;;
      StateDirectory=* | CacheDirectory=* | LogsDirectory=*)
        local base=/var/lib
        case $line in CacheDirectory=*) base=/var/cache ;; LogsDirectory=*) base=/var/log ;; esac
        for p in ${line#*=}; do
          own "$base/${p%%:*}" || report "$file: $line"
        done
        ;;
    esac
  done <"$file"
}

[ $# -gt 0 ] || { echo "usage: $0 FILE..." >&2; exit 2; }
for f in "$@"; do
  [ -f "$f" ] || { echo "$f: no such file" >&2; exit 2; }
  case $f in
    *.service | *.socket | *.timer) check_unit "$f" ;;
    *) check_tmpfiles "$f" ;;
  esac
done
exit $bad
