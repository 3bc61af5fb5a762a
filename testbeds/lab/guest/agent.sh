# The command agent: one shell command per line from the host on the command port; its
# output, then "@@END <exit code>". A virtio port reads EOF while the host end is closed,
# so the loop reopens it. A command that starts a daemon must redirect its output, or
# the command substitution waits for it.
port=/dev/virtio-ports/org.vmigrater.cmd.0
while true; do
    exec 3<>"$port"
    while read -r line <&3; do
        out=$(sh -c "$line" 2>&1)
        rc=$?
        printf '%s\n@@END %d\n' "$out" "$rc" >&3
    done
    exec 3<&-
    sleep 0.2
done
