/*
 * xla_ffi.h -- the XLA FFI C ABI (API 0.x), written from XLA's public
 * specification (xla/ffi/api/c_api.h).  Only the structs, constants and
 * function-table entries ringattn's handlers use; the names are ours so this
 * header never clashes with XLA's own.  Building ringattn never needs
 * jaxlib: tests/test_jax_ffi_abi.py compiles a C file that includes both
 * this header and jaxlib's and asserts (offsetof / sizeof) that the layouts
 * match, so an ABI drift is caught when jaxlib's headers are at hand.
 *
 * How XLA calls a handler (a plain C function registered through jax.ffi):
 * once at registration with a call frame whose extension_start is a
 * metadata extension (the handler fills in the API version it was written
 * against and its traits, and returns NULL; `api` may be NULL then), and
 * then once per execution with the arguments, results and attributes.
 * Every struct XLA passes carries its size; a handler checks it before
 * reading fields a smaller (older) struct would not have.
 */
#ifndef RA_XLA_FFI_H
#define RA_XLA_FFI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The API version our handlers report: the oldest one XLA accepts whose
 * call frame, buffer and attribute layouts are the ones below.  Entries of
 * the function table are read only after checking the table's struct_size. */
#define RA_FFI_API_MAJOR 0
#define RA_FFI_API_MINOR 1

/* offsetof(T, last) + sizeof(last): the size XLA stores in struct_size */
#define RA_FFI_STRUCT_SIZE(T, last)                                           \
    (offsetof(T, last) + sizeof(((T *)0)->last))

/* ---- extensions --------------------------------------------------------- */
enum { RA_FFI_EXTENSION_METADATA = 1 };

typedef struct ra_ffi_extension {
    size_t struct_size;
    int type;                          /* RA_FFI_EXTENSION_* */
    struct ra_ffi_extension *next;
} ra_ffi_extension;

typedef struct ra_ffi_api_version {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    int major_version;
    int minor_version;
} ra_ffi_api_version;

/* ---- errors ------------------------------------------------------------- */
typedef struct ra_ffi_error ra_ffi_error;   /* opaque, owned by XLA */

enum {
    RA_FFI_ERR_INVALID_ARGUMENT = 3,
    RA_FFI_ERR_RESOURCE_EXHAUSTED = 8,
    RA_FFI_ERR_FAILED_PRECONDITION = 9,
    RA_FFI_ERR_UNIMPLEMENTED = 12,
    RA_FFI_ERR_INTERNAL = 13
};

typedef struct ra_ffi_error_create_args {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    const char *message;
    int errc;                          /* RA_FFI_ERR_* (absl status codes) */
} ra_ffi_error_create_args;

typedef ra_ffi_error *ra_ffi_error_create_fn(ra_ffi_error_create_args *args);

/* ---- data types (xla::PrimitiveType values) ------------------------------ */
enum {
    RA_FFI_PRED = 1,
    RA_FFI_S8 = 2,
    RA_FFI_S16 = 3,
    RA_FFI_S32 = 4,
    RA_FFI_S64 = 5,
    RA_FFI_U8 = 6,
    RA_FFI_U16 = 7,
    RA_FFI_U32 = 8,
    RA_FFI_U64 = 9,
    RA_FFI_F16 = 10,
    RA_FFI_F32 = 11,
    RA_FFI_F64 = 12,
    RA_FFI_BF16 = 16
};

/* ---- arguments, results, attributes --------------------------------------- */
enum { RA_FFI_ARG_BUFFER = 1 };
enum { RA_FFI_RET_BUFFER = 1 };
enum {
    RA_FFI_ATTR_ARRAY = 1,
    RA_FFI_ATTR_DICTIONARY = 2,
    RA_FFI_ATTR_SCALAR = 3,
    RA_FFI_ATTR_STRING = 4
};

/* A dense row-major array (the default layout of jax.ffi.ffi_call). */
typedef struct ra_ffi_buffer {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    int dtype;                         /* RA_FFI_F32, ... */
    void *data;
    int64_t rank;
    int64_t *dims;                     /* rank entries */
} ra_ffi_buffer;

typedef struct ra_ffi_bytespan {
    const char *ptr;                   /* not NUL-terminated */
    size_t len;
} ra_ffi_bytespan;

typedef struct ra_ffi_scalar {
    int dtype;
    void *value;
} ra_ffi_scalar;

typedef struct ra_ffi_array {
    int dtype;
    size_t size;
    void *data;
} ra_ffi_array;

typedef struct ra_ffi_args {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    int64_t size;
    int *types;                        /* RA_FFI_ARG_* */
    void **args;                       /* ra_ffi_buffer * */
} ra_ffi_args;

typedef struct ra_ffi_rets {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    int64_t size;
    int *types;                        /* RA_FFI_RET_* */
    void **rets;                       /* ra_ffi_buffer * */
} ra_ffi_rets;

/* Sorted by name. */
typedef struct ra_ffi_attrs {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    int64_t size;
    int *types;                        /* RA_FFI_ATTR_* */
    ra_ffi_bytespan **names;
    void **attrs;                      /* ra_ffi_scalar *, ra_ffi_array *, ... */
} ra_ffi_attrs;

/* ---- call frame ----------------------------------------------------------- */
enum { RA_FFI_STAGE_EXECUTE = 3 };

typedef struct ra_ffi_api ra_ffi_api;

typedef struct ra_ffi_call_frame {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    const ra_ffi_api *api;
    void *ctx;                         /* XLA_FFI_ExecutionContext * */
    int stage;                         /* RA_FFI_STAGE_* */
    ra_ffi_args args;
    ra_ffi_rets rets;
    ra_ffi_attrs attrs;
    void *future;                      /* out; unused: handlers are synchronous */
} ra_ffi_call_frame;

typedef ra_ffi_error *ra_ffi_handler(ra_ffi_call_frame *frame);

/* ---- metadata (the registration-time query) ------------------------------- */
typedef struct ra_ffi_type_id {
    int64_t type_id;
} ra_ffi_type_id;

typedef struct ra_ffi_metadata {
    size_t struct_size;
    ra_ffi_api_version api_version;
    uint32_t traits;                   /* 0: not command-buffer compatible */
    ra_ffi_type_id state_type_id;
} ra_ffi_metadata;

typedef struct ra_ffi_metadata_extension {
    ra_ffi_extension extension_base;
    ra_ffi_metadata *metadata;
} ra_ffi_metadata_extension;

/* ---- the CUDA stream of this execution ------------------------------------ */
typedef struct ra_ffi_stream_get_args {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    void *ctx;
    void *stream;                      /* out: cudaStream_t */
} ra_ffi_stream_get_args;

typedef ra_ffi_error *ra_ffi_stream_get_fn(ra_ffi_stream_get_args *args);

/* ---- the function table XLA hands every call ------------------------------ */
struct ra_ffi_api {
    size_t struct_size;
    ra_ffi_extension *extension_start;
    ra_ffi_api_version api_version;
    const void *internal_api;
    ra_ffi_error_create_fn *error_create;
    void *error_get_message;
    void *error_destroy;
    void *handler_register;
    ra_ffi_stream_get_fn *stream_get;
    /* later entries (types, state, device memory, thread pool, futures,
     * run id, device ordinal) are not used by ringattn */
};

#ifdef __cplusplus
}
#endif
#endif /* RA_XLA_FFI_H */
