/*
 * xla_ffi_abi.c -- compile-time check that ringattn's own definitions of
 * the XLA FFI C ABI (csrc/xla/xla_ffi.h) lay out every struct, field and
 * constant ringattn uses exactly as jaxlib's header (xla/ffi/api/c_api.h)
 * does.  tests/test_jax_ffi_abi.py compiles it with -fsyntax-only against
 * the installed jaxlib's headers (jax.ffi.include_dir()); any drift is a
 * compile error naming the field.
 */
#include <stddef.h>

#include "xla/ffi/api/c_api.h"
#include "xla_ffi.h"

#define SAME_SIZE(ours, theirs)                                               \
    _Static_assert(sizeof(ours) == sizeof(theirs), "size of " #ours)
#define SAME_FIELD(ours, of, theirs, tf)                                      \
    _Static_assert(offsetof(ours, of) == offsetof(theirs, tf) &&              \
                       sizeof(((ours *)0)->of) == sizeof(((theirs *)0)->tf),  \
                   #ours "." #of)
#define SAME_VALUE(ours, theirs)                                              \
    _Static_assert((long)(ours) == (long)(theirs), #ours)

SAME_SIZE(ra_ffi_extension, XLA_FFI_Extension_Base);
SAME_FIELD(ra_ffi_extension, struct_size, XLA_FFI_Extension_Base, struct_size);
SAME_FIELD(ra_ffi_extension, type, XLA_FFI_Extension_Base, type);
SAME_FIELD(ra_ffi_extension, next, XLA_FFI_Extension_Base, next);
SAME_VALUE(RA_FFI_EXTENSION_METADATA, XLA_FFI_Extension_Metadata);

SAME_SIZE(ra_ffi_api_version, XLA_FFI_Api_Version);
SAME_FIELD(ra_ffi_api_version, struct_size, XLA_FFI_Api_Version, struct_size);
SAME_FIELD(ra_ffi_api_version, extension_start, XLA_FFI_Api_Version, extension_start);
SAME_FIELD(ra_ffi_api_version, major_version, XLA_FFI_Api_Version, major_version);
SAME_FIELD(ra_ffi_api_version, minor_version, XLA_FFI_Api_Version, minor_version);
SAME_VALUE(RA_FFI_API_MAJOR, XLA_FFI_API_MAJOR);
_Static_assert(RA_FFI_API_MINOR <= XLA_FFI_API_MINOR, "API minor version");

SAME_SIZE(ra_ffi_error_create_args, XLA_FFI_Error_Create_Args);
SAME_FIELD(ra_ffi_error_create_args, struct_size, XLA_FFI_Error_Create_Args, struct_size);
SAME_FIELD(ra_ffi_error_create_args, extension_start, XLA_FFI_Error_Create_Args, extension_start);
SAME_FIELD(ra_ffi_error_create_args, message, XLA_FFI_Error_Create_Args, message);
SAME_FIELD(ra_ffi_error_create_args, errc, XLA_FFI_Error_Create_Args, errc);
SAME_VALUE(RA_FFI_ERR_INVALID_ARGUMENT, XLA_FFI_Error_Code_INVALID_ARGUMENT);
SAME_VALUE(RA_FFI_ERR_RESOURCE_EXHAUSTED, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED);
SAME_VALUE(RA_FFI_ERR_FAILED_PRECONDITION, XLA_FFI_Error_Code_FAILED_PRECONDITION);
SAME_VALUE(RA_FFI_ERR_UNIMPLEMENTED, XLA_FFI_Error_Code_UNIMPLEMENTED);
SAME_VALUE(RA_FFI_ERR_INTERNAL, XLA_FFI_Error_Code_INTERNAL);

SAME_VALUE(RA_FFI_PRED, XLA_FFI_DataType_PRED);
SAME_VALUE(RA_FFI_S8, XLA_FFI_DataType_S8);
SAME_VALUE(RA_FFI_S16, XLA_FFI_DataType_S16);
SAME_VALUE(RA_FFI_S32, XLA_FFI_DataType_S32);
SAME_VALUE(RA_FFI_S64, XLA_FFI_DataType_S64);
SAME_VALUE(RA_FFI_U8, XLA_FFI_DataType_U8);
SAME_VALUE(RA_FFI_U16, XLA_FFI_DataType_U16);
SAME_VALUE(RA_FFI_U32, XLA_FFI_DataType_U32);
SAME_VALUE(RA_FFI_U64, XLA_FFI_DataType_U64);
SAME_VALUE(RA_FFI_F16, XLA_FFI_DataType_F16);
SAME_VALUE(RA_FFI_F32, XLA_FFI_DataType_F32);
SAME_VALUE(RA_FFI_F64, XLA_FFI_DataType_F64);
SAME_VALUE(RA_FFI_BF16, XLA_FFI_DataType_BF16);
SAME_SIZE(int, XLA_FFI_DataType);

SAME_VALUE(RA_FFI_ARG_BUFFER, XLA_FFI_ArgType_BUFFER);
SAME_VALUE(RA_FFI_RET_BUFFER, XLA_FFI_RetType_BUFFER);
SAME_VALUE(RA_FFI_ATTR_ARRAY, XLA_FFI_AttrType_ARRAY);
SAME_VALUE(RA_FFI_ATTR_DICTIONARY, XLA_FFI_AttrType_DICTIONARY);
SAME_VALUE(RA_FFI_ATTR_SCALAR, XLA_FFI_AttrType_SCALAR);
SAME_VALUE(RA_FFI_ATTR_STRING, XLA_FFI_AttrType_STRING);
SAME_SIZE(int, XLA_FFI_ArgType);
SAME_SIZE(int, XLA_FFI_RetType);
SAME_SIZE(int, XLA_FFI_AttrType);

SAME_SIZE(ra_ffi_buffer, XLA_FFI_Buffer);
SAME_FIELD(ra_ffi_buffer, struct_size, XLA_FFI_Buffer, struct_size);
SAME_FIELD(ra_ffi_buffer, extension_start, XLA_FFI_Buffer, extension_start);
SAME_FIELD(ra_ffi_buffer, dtype, XLA_FFI_Buffer, dtype);
SAME_FIELD(ra_ffi_buffer, data, XLA_FFI_Buffer, data);
SAME_FIELD(ra_ffi_buffer, rank, XLA_FFI_Buffer, rank);
SAME_FIELD(ra_ffi_buffer, dims, XLA_FFI_Buffer, dims);

SAME_SIZE(ra_ffi_bytespan, XLA_FFI_ByteSpan);
SAME_FIELD(ra_ffi_bytespan, ptr, XLA_FFI_ByteSpan, ptr);
SAME_FIELD(ra_ffi_bytespan, len, XLA_FFI_ByteSpan, len);
SAME_SIZE(ra_ffi_scalar, XLA_FFI_Scalar);
SAME_FIELD(ra_ffi_scalar, dtype, XLA_FFI_Scalar, dtype);
SAME_FIELD(ra_ffi_scalar, value, XLA_FFI_Scalar, value);
SAME_SIZE(ra_ffi_array, XLA_FFI_Array);
SAME_FIELD(ra_ffi_array, dtype, XLA_FFI_Array, dtype);
SAME_FIELD(ra_ffi_array, size, XLA_FFI_Array, size);
SAME_FIELD(ra_ffi_array, data, XLA_FFI_Array, data);

SAME_SIZE(ra_ffi_args, XLA_FFI_Args);
SAME_FIELD(ra_ffi_args, struct_size, XLA_FFI_Args, struct_size);
SAME_FIELD(ra_ffi_args, extension_start, XLA_FFI_Args, extension_start);
SAME_FIELD(ra_ffi_args, size, XLA_FFI_Args, size);
SAME_FIELD(ra_ffi_args, types, XLA_FFI_Args, types);
SAME_FIELD(ra_ffi_args, args, XLA_FFI_Args, args);
SAME_SIZE(ra_ffi_rets, XLA_FFI_Rets);
SAME_FIELD(ra_ffi_rets, size, XLA_FFI_Rets, size);
SAME_FIELD(ra_ffi_rets, types, XLA_FFI_Rets, types);
SAME_FIELD(ra_ffi_rets, rets, XLA_FFI_Rets, rets);
SAME_SIZE(ra_ffi_attrs, XLA_FFI_Attrs);
SAME_FIELD(ra_ffi_attrs, size, XLA_FFI_Attrs, size);
SAME_FIELD(ra_ffi_attrs, types, XLA_FFI_Attrs, types);
SAME_FIELD(ra_ffi_attrs, names, XLA_FFI_Attrs, names);
SAME_FIELD(ra_ffi_attrs, attrs, XLA_FFI_Attrs, attrs);

SAME_SIZE(ra_ffi_call_frame, XLA_FFI_CallFrame);
SAME_FIELD(ra_ffi_call_frame, struct_size, XLA_FFI_CallFrame, struct_size);
SAME_FIELD(ra_ffi_call_frame, extension_start, XLA_FFI_CallFrame, extension_start);
SAME_FIELD(ra_ffi_call_frame, api, XLA_FFI_CallFrame, api);
SAME_FIELD(ra_ffi_call_frame, ctx, XLA_FFI_CallFrame, ctx);
SAME_FIELD(ra_ffi_call_frame, stage, XLA_FFI_CallFrame, stage);
SAME_FIELD(ra_ffi_call_frame, args, XLA_FFI_CallFrame, args);
SAME_FIELD(ra_ffi_call_frame, rets, XLA_FFI_CallFrame, rets);
SAME_FIELD(ra_ffi_call_frame, attrs, XLA_FFI_CallFrame, attrs);
SAME_FIELD(ra_ffi_call_frame, future, XLA_FFI_CallFrame, future);
SAME_VALUE(RA_FFI_STRUCT_SIZE(ra_ffi_call_frame, attrs), XLA_FFI_CallFrame_STRUCT_SIZE);
SAME_VALUE(RA_FFI_STAGE_EXECUTE, XLA_FFI_ExecutionStage_EXECUTE);
SAME_SIZE(int, XLA_FFI_ExecutionStage);

SAME_SIZE(ra_ffi_metadata, XLA_FFI_Metadata);
SAME_FIELD(ra_ffi_metadata, struct_size, XLA_FFI_Metadata, struct_size);
SAME_FIELD(ra_ffi_metadata, api_version, XLA_FFI_Metadata, api_version);
SAME_FIELD(ra_ffi_metadata, traits, XLA_FFI_Metadata, traits);
SAME_FIELD(ra_ffi_metadata, state_type_id, XLA_FFI_Metadata, state_type_id);
SAME_VALUE(RA_FFI_STRUCT_SIZE(ra_ffi_metadata, traits), XLA_FFI_Metadata_STRUCT_SIZE);
SAME_SIZE(ra_ffi_metadata_extension, XLA_FFI_Metadata_Extension);
SAME_FIELD(ra_ffi_metadata_extension, extension_base, XLA_FFI_Metadata_Extension, extension_base);
SAME_FIELD(ra_ffi_metadata_extension, metadata, XLA_FFI_Metadata_Extension, metadata);
SAME_VALUE(RA_FFI_STRUCT_SIZE(ra_ffi_metadata_extension, metadata),
           XLA_FFI_Metadata_Extension_STRUCT_SIZE);

SAME_SIZE(ra_ffi_stream_get_args, XLA_FFI_Stream_Get_Args);
SAME_FIELD(ra_ffi_stream_get_args, struct_size, XLA_FFI_Stream_Get_Args, struct_size);
SAME_FIELD(ra_ffi_stream_get_args, extension_start, XLA_FFI_Stream_Get_Args, extension_start);
SAME_FIELD(ra_ffi_stream_get_args, ctx, XLA_FFI_Stream_Get_Args, ctx);
SAME_FIELD(ra_ffi_stream_get_args, stream, XLA_FFI_Stream_Get_Args, stream);

/* the table: our prefix of XLA's, entry for entry */
SAME_FIELD(ra_ffi_api, struct_size, XLA_FFI_Api, struct_size);
SAME_FIELD(ra_ffi_api, extension_start, XLA_FFI_Api, extension_start);
SAME_FIELD(ra_ffi_api, api_version, XLA_FFI_Api, api_version);
SAME_FIELD(ra_ffi_api, internal_api, XLA_FFI_Api, internal_api);
SAME_FIELD(ra_ffi_api, error_create, XLA_FFI_Api, XLA_FFI_Error_Create);
SAME_FIELD(ra_ffi_api, error_get_message, XLA_FFI_Api, XLA_FFI_Error_GetMessage);
SAME_FIELD(ra_ffi_api, error_destroy, XLA_FFI_Api, XLA_FFI_Error_Destroy);
SAME_FIELD(ra_ffi_api, handler_register, XLA_FFI_Api, XLA_FFI_Handler_Register);
SAME_FIELD(ra_ffi_api, stream_get, XLA_FFI_Api, XLA_FFI_Stream_Get);

/* our handlers have XLA's handler type */
static ra_ffi_error *probe(ra_ffi_call_frame *f) { (void)f; return NULL; }
XLA_FFI_Handler *const ra_abi_handler = (XLA_FFI_Handler *)probe;
