# Jupyter Server settings for pt-multi-gpu; loaded by supervisor.py with
#   jupyter-lab --config=/opt/pt-multi-gpu/entrypoint/jupyter_server_config.py
# after the user's own ~/.jupyter config, so these safety settings win.
# Secrets come as files (PTMG_JUPYTER_*_FILE, written mode 0600 by supervisor.py),
# not as environment variables that kernels would inherit.
import os

c = get_config()  # type: ignore[name-defined]  # noqa: F821  (provided by traitlets when it loads this file)

c.ServerApp.ip = "0.0.0.0"
c.ServerApp.port = int(os.environ.get("JUPYTER_PORT", "8888"))
c.ServerApp.port_retries = 0  # a busy port is an error, not a silent move to 8889
c.ServerApp.open_browser = False
c.ServerApp.root_dir = os.environ.get("PTMG_WORKDIR", "/workspace")
c.ServerApp.allow_root = False
c.ServerApp.allow_origin = ""  # never "*"
c.ServerApp.allow_origin_pat = ""
c.ServerApp.disable_check_xsrf = False
c.KernelManager.shutdown_wait_time = 1.0  # docker stop must finish within seconds
c.LabApp.news_url = None  # no calls home from clusters that often have no internet

_token_file = os.environ.get("PTMG_JUPYTER_TOKEN_FILE")
if _token_file:
    with open(_token_file) as f:
        _token = f.read().strip()
    if not _token:
        raise SystemExit("pt-multi-gpu: refusing to start Jupyter with an empty token")
    c.IdentityProvider.token = _token
_hash_file = os.environ.get("PTMG_JUPYTER_PASSWORD_HASH_FILE")
if _hash_file:
    with open(_hash_file) as f:
        c.PasswordIdentityProvider.hashed_password = f.read().strip()
# A token holder must not be able to set a password that outlives the container's config.
c.PasswordIdentityProvider.allow_password_change = False

# TensorBoard runs under the supervisor on localhost; Jupyter proxies it at
# /tensorboard/ behind its own login (jupyter-server-proxy, no process launched here).
_tb_port = os.environ.get("PTMG_TENSORBOARD_PROXY_PORT")
if _tb_port:
    c.ServerProxy.servers = {
        "tensorboard": {
            "command": [],
            "port": int(_tb_port),
            "absolute_url": False,
            "timeout": 30,
            "launcher_entry": {"enabled": True, "title": "TensorBoard"},
            "new_browser_tab": True,
        }
    }
