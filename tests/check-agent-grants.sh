#!/usr/bin/env bash
# Fails (exit 1, naming each line) when a tmpfiles snippet or a systemd unit given as argument
# gives the agent's user (felhom-agent) write access to a path outside the agent's own folders
# (/var/lib/felhom-agent, /var/lib/felhom-agent-metrics and below). Root must never write in a
# folder that user may write: a planted link there would steer root's write.
#
# tmpfiles lines: an ACL (a, a+, A, A+) with a u:/g:felhom-agent entry holding w; a path made
# or adjusted (d, D, e, v, q, Q, z, Z, f, f+, F, w, w+, C, C+, x…) owned by felhom-agent with
# the owner's write bit, or of group felhom-agent with the group's write bit. Units with
# User=felhom-agent: every ReadWritePaths= entry and StateDirectory=/CacheDirectory=/
# LogsDirectory= name. Usage: check-agent-grants.sh FILE...
set -u
user=felhom-agent
bad=0

own() {
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
          case $e in
            u:$user:* | user:$user:* | g:$user:* | group:$user:*)
              case ${e##*:} in *w*) own "$path" || report "$file: $type $path ... $arg" ;; esac ;;
          esac
        done
        ;;
      L* | r* | R* | t* | T* | h* | H* | p* | c* | b*) ;;
      *)
        # The default mode of a made folder or file gives its owner write access.
        local m=${mode#\~}
        [ "$m" = - ] && m=0755
        local ow=$(((8#$m >> 7) & 1)) gw=$(((8#$m >> 4) & 1))
        if { [ "$owner" = "$user" ] && [ "$ow" = 1 ]; } || { [ "$group" = "$user" ] && [ "$gw" = 1 ]; }; then
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
