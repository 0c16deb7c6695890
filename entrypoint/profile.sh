# /etc/profile.d/pt-multi-gpu.sh (copied there at build time, root-owned): the container's
# environment for login shells (Debian's /etc/profile resets PATH), for pt only. The file
# it sources is written by pt at start, so root's login shells never read it.
_ptmg_uid=$(/usr/bin/id -u)
if [ "$_ptmg_uid" != 0 ]; then
    for _ptmg_env in /run/pt-multi-gpu/session-env.sh "/tmp/pt-multi-gpu-$_ptmg_uid/session-env.sh"; do
        if [ -r "$_ptmg_env" ] && [ -O "$_ptmg_env" ]; then
            . "$_ptmg_env"
            break
        fi
    done
fi
unset _ptmg_uid _ptmg_env
