// Runs a GGUF model in llama.cpp on given token ids and writes every tensor its graph computes (through the
// evaluation callback, `cb_eval`) and the logits of every position, as a raw dump that
// scripts/make_gguf_fixtures.py turns into safetensors.
//
// Built by scripts/make_gguf_fixtures.py against a llama.cpp build (libllama, libggml); not part of the crates.
//
//   llama_dump MODEL.gguf OUT.bin TOKEN_ID... [--no-extra-bufts]
//
// OUT.bin: records of  u32 kind (0 tensor, 1 logits) | u32 name length | name | u32 ggml type of the source |
// u32 n_dims | i64 ne[4] | f32 data (ne[0] fastest).  Tensors of a non-float type (token ids, positions) are skipped.
// Exit 0 on success, 2 on a usage or load error, 1 on a failed decode.

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Dump {
    FILE * out = nullptr;
    int tensors = 0;
    int skipped = 0;
};

void write_record(FILE * out, uint32_t kind, const std::string & name, uint32_t type, const int64_t ne[4],
                  uint32_t n_dims, const std::vector<float> & data) {
    const uint32_t len = (uint32_t) name.size();
    fwrite(&kind, 4, 1, out);
    fwrite(&len, 4, 1, out);
    fwrite(name.data(), 1, len, out);
    fwrite(&type, 4, 1, out);
    fwrite(&n_dims, 4, 1, out);
    fwrite(ne, 8, 4, out);
    fwrite(data.data(), 4, data.size(), out);
}

// One element at byte offset `at` of a host copy, widened to f32.
float element(const uint8_t * base, size_t at, ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32: {
            float v;
            memcpy(&v, base + at, 4);
            return v;
        }
        case GGML_TYPE_F16: {
            ggml_fp16_t v;
            memcpy(&v, base + at, 2);
            return ggml_fp16_to_fp32(v);
        }
        case GGML_TYPE_BF16: {
            ggml_bf16_t v;
            memcpy(&v, base + at, 2);
            return ggml_bf16_to_fp32(v);
        }
        default:
            abort();
    }
}

bool on_tensor(ggml_tensor * t, bool ask, void * user_data) {
    auto * dump = (Dump *) user_data;
    if (ask) {
        return true;  // every tensor
    }
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16) {
        dump->skipped++;
        return true;
    }
    // A host copy of the bytes the view spans (the tensor may live in a backend buffer and be strided).
    const size_t bytes = ggml_nbytes(t);
    std::vector<uint8_t> host(bytes);
    if (ggml_backend_buffer_is_host(t->buffer)) {
        memcpy(host.data(), t->data, bytes);
    } else {
        ggml_backend_tensor_get(t, host.data(), 0, bytes);
    }
    std::vector<float> data;
    data.reserve(ggml_nelements(t));
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    const size_t at = i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1] + i0 * t->nb[0];
                    data.push_back(element(host.data(), at, t->type));
                }
            }
        }
    }
    write_record(dump->out, 0, ggml_get_name(t), (uint32_t) t->type, t->ne, (uint32_t) ggml_n_dims(t), data);
    dump->tensors++;
    return true;
}

}  // namespace

int main(int argc, char ** argv) {
    std::vector<llama_token> tokens;
    bool extra_bufts = true;
    std::vector<const char *> positional;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--no-extra-bufts") == 0) {
            extra_bufts = false;
        } else {
            positional.push_back(argv[i]);
        }
    }
    if (positional.size() < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin TOKEN_ID... [--no-extra-bufts]\n", argv[0]);
        return 2;
    }
    for (size_t i = 2; i < positional.size(); i++) {
        char * end = nullptr;
        const long id = strtol(positional[i], &end, 10);
        if (*end != '\0' || id < 0) {
            fprintf(stderr, "token id `%s` is not a non-negative integer\n", positional[i]);
            return 2;
        }
        tokens.push_back((llama_token) id);
    }

    llama_backend_init();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.use_extra_bufts = extra_bufts;
    llama_model * model = llama_model_load_from_file(positional[0], mparams);
    if (model == nullptr) {
        fprintf(stderr, "%s: llama.cpp could not load the model\n", positional[0]);
        return 2;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (llama_token id : tokens) {
        if (id >= n_vocab) {
            fprintf(stderr, "token id %d is out of the vocabulary (%d tokens)\n", id, n_vocab);
            return 2;
        }
    }

    FILE * out = fopen(positional[1], "wb");
    if (out == nullptr) {
        fprintf(stderr, "%s: cannot open for writing\n", positional[1]);
        return 2;
    }
    Dump dump;
    dump.out = out;

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 64;
    cparams.n_batch = (uint32_t) tokens.size();
    cparams.n_ubatch = (uint32_t) tokens.size();
    cparams.n_threads = 1;
    cparams.n_threads_batch = 1;
    cparams.cb_eval = on_tensor;
    cparams.cb_eval_user_data = &dump;
    cparams.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "llama.cpp could not create a context\n");
        return 2;
    }

    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = (int32_t) tokens.size();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    std::vector<float> logits;
    for (size_t i = 0; i < tokens.size(); i++) {
        const float * row = llama_get_logits_ith(ctx, (int32_t) i);
        logits.insert(logits.end(), row, row + n_vocab);
    }
    const int64_t ne[4] = { n_vocab, (int64_t) tokens.size(), 1, 1 };
    write_record(out, 1, "logits", GGML_TYPE_F32, ne, 2, logits);
    fclose(out);
    fprintf(stderr, "%d tensors written, %d of other types skipped\n", dump.tensors, dump.skipped);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
