# /etc/profile.d/pt-multi-gpu.sh (copied there at build time, root-owned): the container's
# environment for login shells (Debian's /etc/profile resets PATH), for every uid but root.
# After the image's entrypoint started: the session file it wrote (pt's own, so root's login
# shells never read it). Without the entrypoint (pyxis/enroot, Apptainer, Charliecloud,
# `docker run --entrypoint`, any uid): the image's PATH, which the image keeps as PTMG_PATH,
# ahead of what /etc/profile set. Root's login PATH stays root-owned (docs/security.md).
_ptmg_uid=$(/usr/bin/id -u)
if [ "$_ptmg_uid" != 0 ]; then
    _ptmg_found=
    for _ptmg_env in /run/pt-multi-gpu/session-env.sh "/tmp/pt-multi-gpu-$_ptmg_uid/session-env.sh"; do
        if [ -r "$_ptmg_env" ] && [ -O "$_ptmg_env" ]; then
            . "$_ptmg_env"
            _ptmg_found=1
            break
        fi
    done
    if [ -z "$_ptmg_found" ] && [ -n "${PTMG_PATH:-}" ]; then
        case ":$PATH:" in
            *":${PTMG_PATH%%:*}:"*) ;;
            *) PATH="$PTMG_PATH${PATH:+:$PATH}"; export PATH ;;
        esac
    fi
fi
unset _ptmg_uid _ptmg_env _ptmg_found
