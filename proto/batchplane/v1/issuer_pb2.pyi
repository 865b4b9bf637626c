from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class IssueRequest(_message.Message):
    __slots__ = ("csr", "token")
    CSR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    csr: bytes
    token: str
    def __init__(self, csr: _Optional[bytes] = ..., token: _Optional[str] = ...) -> None: ...

class IssueResponse(_message.Message):
    __slots__ = ("certificate", "ca", "identity")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CA_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    ca: bytes
    identity: str
    def __init__(self, certificate: _Optional[bytes] = ..., ca: _Optional[bytes] = ..., identity: _Optional[str] = ...) -> None: ...
