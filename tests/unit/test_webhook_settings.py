"""``memops run``'s webhook flags become Kopf's admission settings."""

from __future__ import annotations

import kopf
import pytest

from memops import cli
from memops.controllers import safetynet_webhook


def test_certificate_files_and_an_unmanaged_configuration() -> None:
    settings = kopf.OperatorSettings()
    safetynet_webhook.configure(
        settings, port=9443, host="0.0.0.0", insecure=False, certfile="/c/tls.crt", pkeyfile="/c/tls.key", managed=False
    )
    server = settings.admission.server
    assert isinstance(server, kopf.WebhookServer)
    assert (server.certfile, server.pkeyfile, server.port, server.addr) == ("/c/tls.crt", "/c/tls.key", 9443, "0.0.0.0")
    assert settings.admission.managed is None, "Kopf must not write a MutatingWebhookConfiguration"


def test_kopf_manages_the_configuration_by_default() -> None:
    settings = kopf.OperatorSettings()
    safetynet_webhook.configure(settings, port=9443, host="127.0.0.1", insecure=True)
    assert settings.admission.managed == safetynet_webhook.CONFIGURATION
    assert settings.admission.server.certfile is None


def test_certificate_without_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--webhook-port", "9443", "--webhook-cert-file", "/c/tls.crt"]) == 2
    assert "--webhook-key-file" in capsys.readouterr().err
