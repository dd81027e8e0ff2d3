"""The strict SGLang fake's weight-update session rule, with the expected replies read from SGLang 0.5.23's source:

- sglang/srt/managers/scheduler_components/weight_updater.py:232-239 (update_weights_from_tensor) and :187-197
  (update_weights_from_distributed): with no open session the call returns success=False and the message
  "<name> must run between begin_weight_update() and end_weight_update()" before it deserializes or loads anything;
- weight_updater.py:309-316: begin_weight_update with a session open returns success=False, "a weight-update session is
  already open; call end_weight_update() first"; :323-329: end_weight_update with none open returns success=False,
  "no weight-update session is open; call begin_weight_update() first";
- weight_updater.py:138-163 (update_weights_from_disk): no session check;
- sglang/srt/entrypoints/http_server.py:1436-1486, :1488-1505: these routes answer {"success", "message"} with HTTP 200
  on success and HTTP 400 (BAD_REQUEST) otherwise.
"""
import requests
import torch

import pytest

from opid_mega.rollout.engine import EngineError
from opid_mega.rollout.sglang_engine import SGLangEngine, serialize_named_tensors
from sglang_fake import StrictSGLang

TENSOR_BODY = {"serialized_named_tensors": ["unused"], "flush_cache": False}
DIST_BODY = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g", "flush_cache": False}


def _post(server, path, body=None):
    r = requests.post(server.url + path, json=body if body is not None else {}, timeout=10)
    return r.status_code, r.json()


@pytest.mark.parametrize("path,body", [("/update_weights_from_tensor", TENSOR_BODY),
                                       ("/update_weights_from_distributed", DIST_BODY)])
def test_an_update_outside_a_session_is_refused_before_any_weight_is_touched(fake_sglang, path, body):
    strict = StrictSGLang()
    strict.memory.release(["weights"])  # a weight write now would kill the server: the refusal comes first
    server = fake_sglang(routes=strict)
    name = path.lstrip("/")
    assert _post(server, path, body) == (400, {"success": False, "message": f"{name} must run between "
                                                                            "begin_weight_update() and "
                                                                            "end_weight_update()"})
    assert strict.updates == 0 and strict.tensor_updates == [] and strict.dead is None
    assert _post(server, "/end_weight_update") == (400, {"success": False, "message": "no weight-update session is "
                                                         "open; call begin_weight_update() first"})


def test_begin_twice_is_refused_and_a_closed_session_refuses_updates_again(fake_sglang):
    strict = StrictSGLang()
    server = fake_sglang(routes=strict)
    payload = serialize_named_tensors([("w", torch.ones(2))], "inline")
    assert _post(server, "/begin_weight_update") == (200, {"success": True, "message": "Success"})
    assert _post(server, "/begin_weight_update") == (400, {"success": False, "message": "a weight-update session is "
                                                           "already open; call end_weight_update() first"})
    body = {"serialized_named_tensors": [payload], "flush_cache": False}
    assert _post(server, "/update_weights_from_tensor", body)[0] == 200 and strict.updates == 1
    assert _post(server, "/end_weight_update") == (200, {"success": True, "message": "Success"})
    status, reply = _post(server, "/update_weights_from_tensor", body)
    assert status == 400 and reply["success"] is False and strict.updates == 1
    assert _post(server, "/update_weights_from_disk", {"model_path": "/ckpt"})[0] == 200  # needs no session
    assert strict.dead is None


def test_the_engine_opens_a_session_and_a_bare_bucket_is_refused(fake_sglang):
    strict = StrictSGLang()
    engine = SGLangEngine(url=fake_sglang(routes=strict).url, max_retries=1)
    bucket = [("model.w", torch.randn(3, generator=torch.Generator().manual_seed(0)))]
    engine.update_weights(list(bucket), version="1")  # begin, one bucket, end
    assert strict.updates == 1 and strict.in_update is False and engine.weight_version() == "1"
    with pytest.raises(EngineError, match=r"HTTP 400: .*update_weights_from_tensor must run between "
                                          r"begin_weight_update\(\) and end_weight_update\(\)"):
        engine.send_bucket(list(bucket))  # without begin_update
    assert strict.updates == 1 and strict.dead is None
